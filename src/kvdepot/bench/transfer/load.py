"""The load one engine puts on a server in `kvdepot bench transfer`: its KV caches of a
model geometry, registered through the seed-compatible worker adapter, and stores and
retrieves kept in flight for a phase.

Both the command's own process (one engine, `transfer`) and each engine process of a
run with several (`transfer_engine`) import it; it imports neither.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvdepot.bench.transfer.limits import GB
from kvdepot.client.kv_export import describe_kv_caches
from kvdepot.testbed.kv_geometry import Geometry
from kvdepot.testbed.server_process import ServerProcess
from kvdepot.transfer.layout import KVLayout, blocks_per_chunk

CHUNK = 256


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
    """Retrieves that failed."""
    compute_tflops: float | None = None
    stored_bytes: int = 0
    retrieved_bytes: int = 0
    stores: int = 0
    """Stores completed."""
    retrieves: int = 0
    """Retrieves completed (failed ones included: see `errors`)."""


class Load:
    """Stores of fresh keys and retrieves of stored ones, each with an engine event."""

    def __init__(self, worker: Any, num_blocks: int, chunks_per_op: int, block_size: int,
                 cuda: bool, chunk_bytes: int, seed: int = 1) -> None:
        """`seed` draws the tokens: engines that must not share keys need different ones."""
        self.worker = worker
        self.rng = np.random.default_rng(seed)
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
    """`kvdepot.bench.transfer.compute_probe` in its own process: bf16 products on the same GPU."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvdepot.bench.transfer.compute_probe"],
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


def run_phase(name: str, server: ServerProcess | None, load: Load, seconds: float, inflight: int,
              stores: bool, retrieves: bool, probe: ComputeProbe | None = None,
              stop_after_bytes: int | None = None) -> Phase:
    worker = load.worker
    pending_stores: set[str] = set()
    pending_retrieves: set[str] = set()
    new_finished: set[str] = set()
    stored_bytes = retrieved_bytes = stores_done = retrieves_done = 0
    cursor = 0
    # Without a server (an engine process of several): the parent measures its cores.
    cpu0 = server.cpu_seconds() if server is not None else 0.0
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
        stored = len(sending & pending_stores)
        retrieved = len(recving & pending_retrieves)
        stores_done, retrieves_done = stores_done + stored, retrieves_done + retrieved
        stored_bytes += stored * load.op_bytes
        retrieved_bytes += retrieved * load.op_bytes
        pending_stores -= sending
        pending_retrieves -= recving
        time.sleep(0.0005)
    elapsed = last - start
    cpu = server.cpu_seconds() - cpu0 if server is not None else 0.0
    engine_cpu = time.process_time() - engine_cpu0
    tflops = probe.stop() if probe is not None else None
    worker.get_block_ids_with_load_errors()  # the same failures, by block: not needed here
    errors = len(worker.get_request_ids_with_load_errors())
    # A failed retrieve loaded nothing (all-or-nothing): its bytes do not count.
    retrieved_bytes = max(0, retrieved_bytes - errors * load.op_bytes)
    return Phase(name, elapsed, stored_bytes / elapsed / GB, retrieved_bytes / elapsed / GB,
                 cpu / elapsed, engine_cpu / elapsed, errors, tflops, stored_bytes,
                 retrieved_bytes, stores_done, retrieves_done)


def copy_path(layout: KVLayout, device: str, mode: str, blocks_per_op: int, num_blocks: int
              ) -> tuple[str, float]:
    """Which way the server moves this layout's bytes, and its mean copy length."""
    from kvdepot.transfer.cuda_copier import batching_driver
    from kvdepot.transfer.cuda_copier import copy_path as server_path

    ids = np.random.default_rng(2).choice(num_blocks, blocks_per_op, replace=False)
    plan = layout.plan(ids, blocks_per_chunk(CHUNK, layout.block_size))
    mean = plan.nbytes / len(plan)
    if device == "cpu":
        return "memcpy per segment", mean
    names = {"dma": "one DMA per segment", "batch": "batched DMAs (no kernel)",
             "kernel": "GPU gather/scatter + one DMA per chunk"}
    batches = batching_driver() is not None
    store, retrieve = (server_path(plan, mode, to_host, batches) for to_host in (True, False))
    if store == retrieve:
        return names[store], mean
    return f"stores {names[store]}, retrieves {names[retrieve]}", mean


PHASES = (("store", True, False), ("retrieve", False, True), ("store+retrieve", True, True))
"""Each phase's name, whether it stores, whether it retrieves."""
COMPUTE_PHASE = ("store+retrieve+compute", True, True)


@dataclass
class EngineKV:
    """One engine's KV caches of a geometry, filled with random bytes, and how the server
    will copy them."""

    geometry: Geometry
    caches: dict[str, torch.Tensor]
    num_blocks: int
    chunk_bytes: int
    copy_path: str
    mean_segment_bytes: float


def build_engine_kv(geometry: Geometry, device: str, chunks_per_op: int, copy_mode: str
                    ) -> EngineKV:
    """On `device` ("cuda": this process's current GPU)."""
    cuda = device == "cuda"
    on = torch.device(device)
    blocks_per_op = chunks_per_op * CHUNK // geometry.block_size
    num_blocks = max(4 * blocks_per_op, 1024 if cuda else 0)
    caches = geometry.build(num_blocks, on)
    for storage in {id(t.untyped_storage()): t.untyped_storage() for t in caches.values()
                    }.values():
        torch.empty(0, dtype=torch.int16, device=on).set_(storage).random_(-32768, 32767)
    storages, specs = describe_kv_caches(caches, geometry.block_size)
    layout = KVLayout(specs, [s.nbytes() for s in storages], geometry.block_size)
    path, mean = copy_path(layout, device, copy_mode, blocks_per_op, num_blocks)
    return EngineKV(geometry, caches, num_blocks, layout.chunk_bytes(CHUNK), path, mean)


def register_engine(server_url: str, kv: EngineKV, model: str, world_size: int = 1,
                    rank: int = 0) -> Any:
    """A worker (the seed-compatible adapter) with `kv` registered, as rank `rank` of
    `world_size`."""
    from kvdepot.integrations.vllm.mp_adapter import LMCacheMPWorkerAdapter

    worker = LMCacheMPWorkerAdapter(server_url, None, model, world_size=world_size,
                                    kv_rank=rank, vllm_block_size=kv.geometry.block_size,
                                    tp_size=world_size)
    try:
        worker.register_kv_caches(kv.caches)
    except BaseException:
        worker.shutdown()
        raise
    return worker


def warm_up(server: ServerProcess | None, load: Load, inflight: int, nbytes: int) -> Phase:
    """Stores of `nbytes`: a long-running server has touched all of its memory; a fresh one
    pays a page fault per first-written page (unpinned CPU pools), which stays out of the
    figures."""
    return run_phase("warm-up", server, load, 60.0, inflight, True, False,
                     stop_after_bytes=nbytes)
