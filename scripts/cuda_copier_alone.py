"""A GPU copy process's copy path alone: several engines' KV caches in this one process,
stores and retrieves queued by `CudaCopier` from one thread (as a copy process's main
thread does) for worker threads that wait for them, no server, sockets or tiers.

Tells whether a ceiling of `kvdepot bench transfer --device cuda --engines N` is in the
copy path (the queueing thread, the GPU) or in the rest of the server: if this reaches
the link where the bench does not, the limit is the server's host work per operation.
Needs a CUDA device:

    python scripts/cuda_copier_alone.py --engines 8 --threads 2 [--profile]

`--profile` adds a CUPTI summary of the both-at-once phase: how busy each copy direction
kept its engine, and the mean duration of each kind of GPU work and CUDA call.
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvdepot.bench.transfer.limits import DIRECTIONS, CudaCopies
from kvdepot.client.kv_export import describe_kv_caches
from kvdepot.testbed.kv_geometry import CUDA_GEOMETRIES
from kvdepot.transfer.cuda_copier import CudaCopier
from kvdepot.transfer.host_chunks import HostChunks
from kvdepot.transfer.layout import KVLayout, blocks_per_chunk

CHUNK_TOKENS = 256
LIMIT_COPY_BYTES = 256 << 20
LIMIT_SECONDS = 1.0


class Copiers:
    """Each engine's KV cache on the current GPU with its copier, and one page-locked pool
    holding a separate operation's chunks per (direction, thread, engine)."""

    def __init__(self, geometry_name: str, engines: int, threads: int, chunks_per_op: int
                 ) -> None:
        geometry = next(g for g in CUDA_GEOMETRIES if g.name == geometry_name)
        device = torch.device("cuda", torch.cuda.current_device())
        self.blocks_per_chunk = blocks_per_chunk(CHUNK_TOKENS, geometry.block_size)
        blocks_per_op = chunks_per_op * self.blocks_per_chunk
        num_blocks = max(4 * blocks_per_op, 1024)
        self.engines: list[tuple[dict[str, torch.Tensor], KVLayout, CudaCopier]] = []
        for _ in range(engines):
            caches = geometry.build(num_blocks, device)
            storages, specs = describe_kv_caches(caches, geometry.block_size)
            layout = KVLayout(specs, [s.nbytes() for s in storages], geometry.block_size)
            tensors = [torch.empty(0, dtype=torch.uint8, device=device).set_(s)
                       for s in storages]
            self.engines.append((caches, layout, CudaCopier(device, tensors, storages)))
        self.chunk_bytes = self.engines[0][1].chunk_bytes(CHUNK_TOKENS)
        self.chunks_per_op = chunks_per_op
        self.op_bytes = self.chunk_bytes * chunks_per_op
        self.threads = threads
        self.pool = torch.empty(2 * threads * engines * self.op_bytes, dtype=torch.uint8,
                                pin_memory=True)
        # The one thread that queues copies on this GPU, as in a copy process.
        self._queueing = ThreadPoolExecutor(1, thread_name_prefix="queue",
                                            initializer=torch.cuda.set_device,
                                            initargs=(device,))
        rng = np.random.default_rng(0)
        self.id_sets = [rng.permutation(num_blocks)[:blocks_per_op].astype(np.int64)
                        for _ in range(64)]

    def operation(self, to_host: bool, thread: int, k: int) -> None:
        """The `k`-th operation of `thread` in its direction, on engine k mod engines."""
        e = k % len(self.engines)
        _, layout, copier = self.engines[e]
        slot = ((int(not to_host) * self.threads + thread) * len(self.engines) + e)
        at = slot * self.op_bytes
        hosts = HostChunks(self.pool, [at + i * self.chunk_bytes
                                       for i in range(self.chunks_per_op)], self.chunk_bytes)
        plan = layout.plan(self.id_sets[k % len(self.id_sets)], self.blocks_per_chunk)
        done = self._queueing.submit(copier.queue, plan, hosts, None, to_host).result()
        if done is not None:
            done.synchronize()


def phase(copiers: Copiers, name: str, stores: bool, retrieves: bool, seconds: float,
          profile: bool) -> None:
    stop = threading.Event()
    measuring = threading.Event()
    lock = threading.Lock()
    moved = {True: 0, False: 0}
    ops = {True: 0, False: 0}

    def worker(to_host: bool, thread: int) -> None:
        k = thread
        while not stop.is_set():
            copiers.operation(to_host, thread, k)
            if measuring.is_set():
                with lock:
                    moved[to_host] += copiers.op_bytes
                    ops[to_host] += 1
            k += 1

    workers = [threading.Thread(target=worker, args=(d, t))
               for d in (True, False) if (stores if d else retrieves)
               for t in range(copiers.threads)]
    for w in workers:
        w.start()
    time.sleep(0.5)  # every worker under way
    profiler = None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as cupti_profile
        profiler = cupti_profile(activities=[ProfilerActivity.CUDA])
        profiler.__enter__()
    cpu = time.process_time()
    measuring.set()
    start = time.perf_counter()
    time.sleep(seconds)
    measuring.clear()
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    if profiler is not None:
        profiler.__exit__(None, None, None)
    stop.set()
    for w in workers:
        w.join()
    s, r = moved[True] / wall / 1e9, moved[False] / wall / 1e9
    print(f"{name:9s} store {s:5.1f} GB/s, retrieve {r:5.1f} GB/s, sum {s + r:5.1f} GB/s; "
          f"{(ops[True] + ops[False]) / wall:.0f} operations/s, {cpu / wall:.2f} cores",
          flush=True)
    if profiler is not None:
        summarize(profiler)


def summarize(profiler: torch.profiler.profile) -> None:
    """Per kind of GPU activity: count, mean duration, and the share of the profiled span
    in which at least one was running (for the two copy directions: how busy the link)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for event in profiler.events():
        name = event.name
        kind = ("copy host to device" if "Memcpy HtoD" in name
                else "copy device to host" if "Memcpy DtoH" in name else name[:60])
        spans.setdefault(kind, []).append((event.time_range.start, event.time_range.end))
    for kind, each in sorted(spans.items()):
        each.sort()
        busy, open_start, open_end = 0.0, each[0][0], each[0][1]
        for s, e in each[1:]:
            if s > open_end:
                busy += open_end - open_start
                open_start, open_end = s, e
            else:
                open_end = max(open_end, e)
        busy += open_end - open_start
        span = max(e for _, e in each) - each[0][0]
        mean = sum(e - s for s, e in each) / len(each)
        print(f"  {kind:60s} {len(each):6d} x {mean:8.1f} us, busy {busy / span:.2f} of "
              f"{span / 1e3:.0f} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--geometry", default="llama70b-tp8-flash-attn",
                   choices=[g.name for g in CUDA_GEOMETRIES])
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="per direction (default 2)")
    p.add_argument("--chunks-per-op", type=int, default=8)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    copiers = Copiers(args.geometry, args.engines, args.threads, args.chunks_per_op)
    print(f"{args.engines} engines of {args.geometry}: chunk {copiers.chunk_bytes / 2**20:.1f}"
          f" MiB, operation {copiers.op_bytes / 1e6:.1f} MB", flush=True)
    limits = CudaCopies(LIMIT_COPY_BYTES)
    h2d, d2h, both = (limits.sustained(d, LIMIT_SECONDS) for d in DIRECTIONS)
    print(f"limits: host to device {h2d:.1f}, device to host {d2h:.1f}, both {both:.1f} GB/s",
          flush=True)
    phase(copiers, "warm-up", True, True, 1.0, False)
    phase(copiers, "store", True, False, args.seconds, False)
    phase(copiers, "retrieve", False, True, args.seconds, False)
    phase(copiers, "both", True, True, args.seconds, args.profile)


if __name__ == "__main__":
    main()
