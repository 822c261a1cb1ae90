"""`kvdepot bench transfer`: store and retrieve bandwidth through a real server.

Starts `kvdepot serve` as its own process, registers a KV cache of a real model geometry
from this process (the engine) through the seed-compatible worker adapter, and keeps
several stores and/or retrieves in flight for a few seconds per phase: stores alone,
retrieves alone, both together. Each figure is printed beside the physical limit
measured in the same run (page-locked cudaMemcpyAsync for `--device cuda`, a plain
large memory copy for `--device cpu`), with the server process's CPU use in cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from kvdepot.bench.kv_geometry import CPU_GEOMETRIES, CUDA_GEOMETRIES, Geometry
from kvdepot.client.kv_export import describe_kv_caches
from kvdepot.options import DEFAULTS
from kvdepot.server_process import ServerProcess
from kvdepot.transfer.cuda_copier import MODE_VARIABLE
from kvdepot.transfer.layout import KVLayout, blocks_per_chunk

CHUNK = 256
GB = 1e9


# ---- the physical limits ----------------------------------------------------------------
def _timed(fn: Any, nbytes: int, repeats: int, sync: Any) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / GB


def cuda_limits(nbytes: int = 1 << 30) -> dict[str, float]:
    """Page-locked cudaMemcpyAsync H2D, D2H, and both at once on two streams."""
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    sync = torch.cuda.synchronize

    def both() -> None:
        with torch.cuda.stream(streams[0]):
            dev[0].copy_(host[0], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            host[1].copy_(dev[1], non_blocking=True)

    return {
        "h2d": _timed(lambda: dev[0].copy_(host[0], non_blocking=True), nbytes, 5, sync),
        "d2h": _timed(lambda: host[0].copy_(dev[0], non_blocking=True), nbytes, 5, sync),
        "both": _timed(both, 2 * nbytes, 5, sync),
    }


def _sustained(fn: Any, nbytes: int, seconds: float) -> tuple[float, float]:
    """(GB/s of back-to-back runs of `fn` over `seconds`, GB/s of the fastest single run)."""
    fn()  # first touch: page faults are no part of a copy's bandwidth
    runs, fastest = 0, float("inf")
    start = end = time.perf_counter()
    while end - start < seconds:
        began = time.perf_counter()
        fn()
        end = time.perf_counter()
        runs, fastest = runs + 1, min(fastest, end - began)
    return runs * nbytes / (end - start) / GB, nbytes / fastest / GB


def cpu_limits(nbytes: int = 512 << 20, threads: int | None = None, seconds: float = 2.0
               ) -> dict[str, float]:
    """The machine's memory-copy bandwidth: memcpy of `nbytes` back to back for `seconds`
    (as long as a phase), by one thread and by several at once (numpy releases the GIL),
    whichever sustains more.

    Several threads, because the server copies on several and a one-thread limit alone
    would flatter it. Sustained, because a phase's figure is an average over its seconds,
    and a best single copy can run well above what the same copies sustain
    (docs/benchmarks.md), so it is no limit a phase could reach. The fastest single
    copies are returned too (`peak_*`) and printed beside."""
    threads = threads or DEFAULTS.transfer_threads
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    one, peak_one = _sustained(lambda: np.copyto(dst, src), nbytes, seconds)
    step = -(-nbytes // threads)
    pool = ThreadPoolExecutor(threads)

    def parallel() -> None:
        list(pool.map(lambda i: np.copyto(dst[i:i + step], src[i:i + step]),
                      range(0, nbytes, step)))

    several, peak_several = _sustained(parallel, nbytes, seconds)
    pool.shutdown()
    best = max(one, several)
    return {"h2d": best, "d2h": best, "both": best, "one_thread": one,
            f"{threads}_threads": several, "peak_one_thread": peak_one,
            f"peak_{threads}_threads": peak_several}


# ---- the load -----------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    seconds: float = 0.0
    store_gbps: float = 0.0
    retrieve_gbps: float = 0.0
    server_cores: float = 0.0
    engine_cores: float = 0.0
    """This process (the engine side), which shares the machine's cores with the server."""
    errors: int = 0
    compute_tflops: float | None = None


@dataclass
class GeometryResult:
    geometry: str
    description: str
    chunk_mib: float
    copy_path: str
    mean_segment_kib: float
    phases: list[Phase] = field(default_factory=list)


class Load:
    """Stores of fresh keys and retrieves of stored ones, each with an engine event."""

    def __init__(self, worker: Any, num_blocks: int, chunks_per_op: int, block_size: int,
                 cuda: bool, chunk_bytes: int) -> None:
        self.worker = worker
        self.rng = np.random.default_rng(1)
        self.num_blocks = num_blocks
        self.blocks_per_op = chunks_per_op * CHUNK // block_size
        self.op_bytes = chunks_per_op * chunk_bytes
        self.tokens_per_op = chunks_per_op * CHUNK
        self.cuda = cuda
        self.retrieve_set: list[np.ndarray] = []
        self._serial = 0

    def _event(self) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event(interprocess=True)
        event.record()
        return event

    def _op(self, tokens: np.ndarray) -> Any:
        from kvdepot.integrations.vllm.mp_adapter import LoadStoreOp

        blocks = self.rng.choice(self.num_blocks, self.blocks_per_op, replace=False)
        return LoadStoreOp(token_ids=tokens, block_ids=blocks, start=0, end=len(tokens))

    def submit_store(self, tokens: np.ndarray | None = None) -> str:
        self._serial += 1
        if tokens is None:
            tokens = self.rng.integers(1, 30000, self.tokens_per_op, dtype=np.int64)
            tokens[0] = self._serial  # fresh keys: every chunk hash chains from this token
        request_id = f"s{self._serial}"
        self.worker.submit_store_request(request_id, self._op(tokens), self._event())
        return request_id

    def fill_retrieve_set(self, count: int) -> None:
        """Store the chunks retrieves will read (again, if stores evicted some) and wait.
        Retrieves then keep them hot: each one moves its chunks to the LRU's recent end."""
        if not self.retrieve_set:
            self.retrieve_set = [self.rng.integers(1, 30000, self.tokens_per_op, dtype=np.int64)
                                 for _ in range(count)]
        pending = {self.submit_store(tokens) for tokens in self.retrieve_set}
        finished = set(pending)
        while pending:
            sending, _ = self.worker.get_finished(finished)
            finished = set()
            pending -= sending
            time.sleep(0.001)

    def submit_retrieve(self, tokens: np.ndarray) -> str:
        self._serial += 1
        request_id = f"r{self._serial}"
        self.worker.submit_retrieve_request(request_id, self._op(tokens), self._event())
        return request_id


class ComputeProbe:
    """`kvdepot.bench.compute_probe` in its own process: bf16 products on the same GPU."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvdepot.bench.compute_probe"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        if self._stdout.readline().strip() != "ready":
            raise RuntimeError("the compute probe did not start")

    def start(self) -> None:
        self._stdin.write("go\n")
        self._stdin.flush()

    def stop(self) -> float:
        """TFLOP/s since start(); the probe process then exits."""
        self._stdin.write("stop\n")
        self._stdin.flush()
        rate = float(self._stdout.readline())
        self.proc.wait()
        return rate


def run_phase(name: str, server: ServerProcess, load: Load, seconds: float, inflight: int,
              stores: bool, retrieves: bool, probe: ComputeProbe | None = None,
              stop_after_bytes: int | None = None) -> Phase:
    worker = load.worker
    pending_stores: set[str] = set()
    pending_retrieves: set[str] = set()
    new_finished: set[str] = set()
    stored_bytes = retrieved_bytes = 0
    cursor = 0
    cpu0 = server.cpu_seconds()
    engine_cpu0 = time.process_time()
    if probe is not None:
        probe.start()
    start = last = time.perf_counter()
    deadline = start + seconds
    while True:
        now = time.perf_counter()
        if stop_after_bytes is not None and stored_bytes >= stop_after_bytes:
            deadline = now
        if now < deadline:
            while stores and len(pending_stores) < inflight:
                request_id = load.submit_store()
                pending_stores.add(request_id)
                new_finished.add(request_id)
            while retrieves and len(pending_retrieves) < inflight:
                tokens = load.retrieve_set[cursor % len(load.retrieve_set)]
                cursor += 1
                pending_retrieves.add(load.submit_retrieve(tokens))
        elif not pending_stores and not pending_retrieves:
            break
        sending, recving = worker.get_finished(new_finished)
        new_finished = set()
        if sending or recving:
            last = time.perf_counter()
        stored_bytes += len(sending & pending_stores) * load.op_bytes
        retrieved_bytes += len(recving & pending_retrieves) * load.op_bytes
        pending_stores -= sending
        pending_retrieves -= recving
        time.sleep(0.0005)
    elapsed = last - start
    cpu = server.cpu_seconds() - cpu0
    engine_cpu = time.process_time() - engine_cpu0
    tflops = probe.stop() if probe is not None else None
    errors = len(worker.get_block_ids_with_load_errors())
    # A failed retrieve loaded nothing (all-or-nothing): its bytes do not count. (Block ids
    # of two failed operations may overlap, so this can only undercount the failures.)
    retrieved_bytes = max(0, retrieved_bytes - errors // load.blocks_per_op * load.op_bytes)
    return Phase(name, elapsed, stored_bytes / elapsed / GB, retrieved_bytes / elapsed / GB,
                 cpu / elapsed, engine_cpu / elapsed, errors, tflops)


def copy_path(layout: KVLayout, device: str, mode: str, blocks_per_op: int, num_blocks: int
              ) -> tuple[str, float]:
    """Which way the server moves this layout's bytes, and its mean copy length."""
    from kvdepot.transfer.cuda_copier import copies_directly

    ids = np.random.default_rng(2).choice(num_blocks, blocks_per_op, replace=False)
    plan = layout.plan(ids, blocks_per_chunk(CHUNK, layout.block_size))
    mean = plan.nbytes / len(plan)
    if device == "cpu":
        return "memcpy per segment", mean
    return ("one DMA per segment" if copies_directly(plan, mode)
            else "GPU gather/scatter + one DMA per chunk"), mean


def bench_geometry(geometry: Geometry, server: ServerProcess, l1_bytes: int,
                   args: argparse.Namespace) -> GeometryResult:
    from kvdepot.integrations.vllm.mp_adapter import LMCacheMPWorkerAdapter

    cuda = args.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    blocks_per_op = args.chunks_per_op * CHUNK // geometry.block_size
    num_blocks = max(4 * blocks_per_op, 1024 if cuda else 0)
    caches = geometry.build(num_blocks, device)
    for storage in {id(t.untyped_storage()): t.untyped_storage() for t in caches.values()
                    }.values():
        torch.empty(0, dtype=torch.int16, device=device).set_(storage).random_(-32768, 32767)
    storages, specs = describe_kv_caches(caches, geometry.block_size)
    layout = KVLayout(specs, [s.nbytes() for s in storages], geometry.block_size)
    chunk_bytes = layout.chunk_bytes(CHUNK)
    path, mean = copy_path(layout, args.device, args.copy_mode, blocks_per_op, num_blocks)
    result = GeometryResult(geometry.name, geometry.description, chunk_bytes / 2**20, path,
                            mean / 1024)
    print(f"\n{geometry.name}: {geometry.description}")
    print(f"  chunk {chunk_bytes / 2**20:.1f} MiB; copies of {mean / 1024:.0f} KiB on average "
          f"-> {path}", flush=True)
    worker = LMCacheMPWorkerAdapter(server.url, None, f"bench-{geometry.name}",
                                    vllm_block_size=geometry.block_size)
    try:
        worker.register_kv_caches(caches)
        load = Load(worker, num_blocks, args.chunks_per_op, geometry.block_size, cuda,
                    chunk_bytes)
        # A long-running server has touched all of its memory; a fresh one pays a page
        # fault per first-written page (unpinned CPU pools), which stays out of the figures.
        warm = run_phase("warm-up", server, load, 60.0, args.inflight, True, False,
                         stop_after_bytes=l1_bytes)
        print(f"  warm-up: stored {warm.store_gbps * warm.seconds:.1f} GB once over the "
              "server's memory", flush=True)
        for name, stores, retrieves, with_probe in (("store", True, False, False),
                                                    ("retrieve", False, True, False),
                                                    ("store+retrieve", True, True, False),
                                                    ("store+retrieve+compute", True, True,
                                                     True)):
            if with_probe and not args.compute_probe:
                continue
            if retrieves:
                load.fill_retrieve_set(args.retrieve_set)
            result.phases.append(run_phase(name, server, load, args.seconds, args.inflight,
                                           stores, retrieves,
                                           ComputeProbe() if with_probe else None))
    finally:
        worker.shutdown()
        del caches
        if cuda:
            torch.cuda.empty_cache()
    return result


# ---- report -------------------------------------------------------------------------------
def _print_result(result: GeometryResult, limits: dict[str, float], compute_alone: float | None,
                  cuda: bool) -> None:
    d2h, h2d, both = ("D2H", "H2D", "both") if cuda else ("memcpy",) * 3
    for p in result.phases:
        parts = []
        if p.store_gbps:
            parts.append(f"store {p.store_gbps:6.1f} GB/s ({p.store_gbps / limits['d2h']:.2f} "
                         f"of {d2h})")
        if p.retrieve_gbps:
            parts.append(f"retrieve {p.retrieve_gbps:6.1f} GB/s "
                         f"({p.retrieve_gbps / limits['h2d']:.2f} of {h2d})")
        if p.store_gbps and p.retrieve_gbps:
            total = p.store_gbps + p.retrieve_gbps
            parts.append(f"sum {total:6.1f} GB/s ({total / limits['both']:.2f} of {both})")
        if p.compute_tflops is not None and compute_alone:
            parts.append(f"matmul {p.compute_tflops:.0f} TFLOP/s "
                         f"({p.compute_tflops / compute_alone:.2f} of alone)")
        errors = f"  {p.errors} LOAD ERRORS" if p.errors else ""
        print(f"  {p.name:23s} " + "; ".join(parts)
              + f"; server {p.server_cores:.2f} cores, engine {p.engine_cores:.2f}{errors}")


def run(args: argparse.Namespace) -> int:
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("kvdepot bench transfer: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    choices = CUDA_GEOMETRIES if cuda else CPU_GEOMETRIES
    geometries = [g for g in choices if not args.geometry or g.name in args.geometry]
    if not geometries:
        print(f"no geometry matches {args.geometry}; choose from "
              f"{[g.name for g in choices]}", file=sys.stderr)
        return 2
    limits = cuda_limits() if cuda else cpu_limits(seconds=args.seconds)
    if cuda:
        print(f"device: {torch.cuda.get_device_name()}; limit, page-locked cudaMemcpyAsync of "
              f"1 GiB: H2D {limits['h2d']:.1f} GB/s, D2H {limits['d2h']:.1f} GB/s, both at "
              f"once {limits['both']:.1f} GB/s")
    else:
        def listed(peaks: bool) -> str:
            return ", ".join(f"{k.removeprefix('peak_').replace('_', ' ')} {v:.1f} GB/s"
                             for k, v in limits.items() if k.endswith(("thread", "threads"))
                             and k.startswith("peak_") == peaks)

        print(f"limit: memcpy of 512 MiB back to back for {args.seconds:.1f} s (as long as a "
              f"phase), the faster of {listed(False)}: {limits['h2d']:.1f} GB/s "
              f"(fastest single copies: {listed(True)})")
    compute_alone = None
    if cuda and args.compute_probe:
        probe = ComputeProbe()
        probe.start()
        time.sleep(args.seconds)
        compute_alone = probe.stop()
        print(f"matmul probe alone (bf16 8192^3, own process): {compute_alone:.0f} TFLOP/s")
    l1_bytes = args.l1_size or ((8 << 30) if cuda else (4 << 30))
    insecure = ("--insecure",) if args.insecure else ()
    server = ServerProcess(l1_size=l1_bytes, env={MODE_VARIABLE: args.copy_mode},
                           extra=("--transfer-threads", str(args.transfer_threads),
                                  "--log-level", "WARNING", *insecure),
                           output="inherit").start()
    results = []
    try:
        print(f"server: transfer threads {args.transfer_threads}, copy mode {args.copy_mode}; "
              f"{args.chunks_per_op} chunks of {CHUNK} tokens per operation, {args.inflight} "
              f"in flight per direction, {args.seconds:.1f} s per phase")
        for geometry in geometries:
            result = bench_geometry(geometry, server, l1_bytes, args)
            _print_result(result, limits, compute_alone, cuda)
            results.append(result)
    finally:
        server.stop()
    # Measured again at the end, keeping the better figure: on a shared machine a single
    # measurement can catch a busy moment and flatter every ratio.
    again = cuda_limits() if cuda else cpu_limits(seconds=args.seconds)
    limits = {k: max(v, again[k]) for k, v in limits.items()}
    print("\nsummary; the limit measured again after the run, ratios to the better of the two: "
          + ", ".join(f"{k} {v:.1f} GB/s" for k, v in limits.items()))
    for result in results:
        print(f"\n{result.geometry}: {result.copy_path}")
        _print_result(result, limits, compute_alone, cuda)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "limits": limits, "compute_alone": compute_alone,
                       "args": {k: v for k, v in vars(args).items() if k != "run"},
                       "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


def add_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("transfer", help="store/retrieve bandwidth against the "
                              "host<->device (or memcpy) limit measured in the same run")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--geometry", action="append",
                   help="run only these geometries (repeatable); default all for the device")
    p.add_argument("--seconds", type=float, default=2.0, help="per phase (default %(default)s)")
    p.add_argument("--chunks-per-op", type=int, default=8,
                   help="chunks per store/retrieve (default %(default)s: 2,048 tokens, the "
                        "smallest scheduler step vLLM uses by default; 8,192 on H100/H200 "
                        "for `vllm serve`)")
    p.add_argument("--inflight", type=int, default=4,
                   help="operations in flight per direction (default %(default)s)")
    p.add_argument("--retrieve-set", type=int, default=4,
                   help="operations stored up front for retrieves to read (default %(default)s)")
    p.add_argument("--copy-mode", choices=("auto", "dma", "kernel"), default="auto",
                   help="the server's CUDA copy path (KVDEPOT_CUDA_COPY; default %(default)s)")
    p.add_argument("--transfer-threads", type=int, default=DEFAULTS.transfer_threads,
                   help="the server's transfer threads (default: its own, here %(default)s)")
    p.add_argument("--l1-size", type=int, default=None, help="server CPU memory in bytes")
    p.add_argument("--insecure", action="store_true",
                   help="run the server without authentication (to measure what it costs)")
    p.add_argument("--compute-probe", action="store_true",
                   help="also run bf16 matmuls beside the copies and report their rate")
    p.add_argument("--json", help="write every figure to this file")
    p.set_defaults(run=run)
