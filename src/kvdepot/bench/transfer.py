"""`kvdepot bench transfer`: store and retrieve bandwidth through a real server.

Starts `kvdepot serve` as its own process, registers a KV cache of a real model geometry
from this process (the engine) through the seed-compatible worker adapter, and keeps
several stores and/or retrieves in flight for a few seconds per phase: stores alone,
retrieves alone, both together. Each figure is printed beside the physical limit
measured in the same run (page-locked cudaMemcpyAsync for `--device cuda`, a plain
large memory copy for `--device cpu`; `transfer_limits`), with the server process's CPU
use in cores. With `--engines`, `--tp` or `--gpus` the engines are processes of their own
(`transfer_engines`), which reuse this module's load, phases and report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from kvdepot.bench.kv_geometry import CPU_GEOMETRIES, CUDA_GEOMETRIES, Geometry
from kvdepot.bench.transfer_limits import GB, cpu_limits, cuda_limits
from kvdepot.client.kv_export import describe_kv_caches
from kvdepot.options import DEFAULTS
from kvdepot.server_process import ServerProcess
from kvdepot.transfer.cuda_copier import MODE_VARIABLE
from kvdepot.transfer.layout import KVLayout, blocks_per_chunk

CHUNK = 256


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
    """Retrieves that failed."""
    compute_tflops: float | None = None
    stored_bytes: int = 0
    retrieved_bytes: int = 0
    stores: int = 0
    """Stores completed."""
    retrieves: int = 0
    """Retrieves completed (failed ones included: see `errors`)."""


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
    from kvdepot.transfer.cuda_copier import copies_directly

    ids = np.random.default_rng(2).choice(num_blocks, blocks_per_op, replace=False)
    plan = layout.plan(ids, blocks_per_chunk(CHUNK, layout.block_size))
    mean = plan.nbytes / len(plan)
    if device == "cpu":
        return "memcpy per segment", mean
    return ("one DMA per segment" if copies_directly(plan, mode)
            else "GPU gather/scatter + one DMA per chunk"), mean


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


def bench_geometry(geometry: Geometry, server: ServerProcess, l1_bytes: int,
                   args: argparse.Namespace) -> GeometryResult:
    cuda = args.device == "cuda"
    kv = build_engine_kv(geometry, args.device, args.chunks_per_op, args.copy_mode)
    result = GeometryResult(geometry.name, geometry.description, kv.chunk_bytes / 2**20,
                            kv.copy_path, kv.mean_segment_bytes / 1024)
    print_geometry(result)
    worker = register_engine(server.url, kv, f"bench-{geometry.name}")
    try:
        load = Load(worker, kv.num_blocks, args.chunks_per_op, geometry.block_size, cuda,
                    kv.chunk_bytes)
        warm = warm_up(server, load, args.inflight, l1_bytes)
        print(f"  warm-up: stored {warm.stored_bytes / GB:.1f} GB once over the "
              "server's memory", flush=True)
        phases = [*PHASES, COMPUTE_PHASE] if args.compute_probe else PHASES
        for name, stores, retrieves in phases:
            if retrieves:
                load.fill_retrieve_set(args.retrieve_set)
            with_probe = (name, stores, retrieves) == COMPUTE_PHASE
            result.phases.append(run_phase(name, server, load, args.seconds, args.inflight,
                                           stores, retrieves,
                                           ComputeProbe() if with_probe else None))
    finally:
        worker.shutdown()
        del kv
        if cuda:
            torch.cuda.empty_cache()
    return result


# ---- report -------------------------------------------------------------------------------
def print_geometry(result: GeometryResult) -> None:
    print(f"\n{result.geometry}: {result.description}")
    print(f"  chunk {result.chunk_mib:.1f} MiB; copies of {result.mean_segment_kib:.0f} KiB on "
          f"average -> {result.copy_path}", flush=True)


def direction_names(cuda: bool) -> tuple[str, str, str]:
    """What the D2H, H2D and both-ways limits are called."""
    return ("D2H", "H2D", "both") if cuda else ("memcpy",) * 3


def rate_parts(store_gbps: float, retrieve_gbps: float, limits: dict[str, float], cuda: bool
               ) -> list[str]:
    """Store, retrieve and their sum, each beside its limit."""
    d2h, h2d, both = direction_names(cuda)
    parts = []
    if store_gbps:
        parts.append(f"store {store_gbps:6.1f} GB/s ({store_gbps / limits['d2h']:.2f} of {d2h})")
    if retrieve_gbps:
        parts.append(f"retrieve {retrieve_gbps:6.1f} GB/s "
                     f"({retrieve_gbps / limits['h2d']:.2f} of {h2d})")
    if store_gbps and retrieve_gbps:
        total = store_gbps + retrieve_gbps
        parts.append(f"sum {total:6.1f} GB/s ({total / limits['both']:.2f} of {both})")
    return parts


def _print_result(result: GeometryResult, limits: dict[str, float], compute_alone: float | None,
                  cuda: bool) -> None:
    for p in result.phases:
        parts = rate_parts(p.store_gbps, p.retrieve_gbps, limits, cuda)
        if p.compute_tflops is not None and compute_alone:
            parts.append(f"matmul {p.compute_tflops:.0f} TFLOP/s "
                         f"({p.compute_tflops / compute_alone:.2f} of alone)")
        errors = f"  {p.errors} LOAD ERRORS" if p.errors else ""
        print(f"  {p.name:23s} " + "; ".join(parts)
              + f"; server {p.server_cores:.2f} cores, engine {p.engine_cores:.2f}{errors}")


def print_cpu_limits(limits: dict[str, float], seconds: float, label: str = "limit") -> None:
    def listed(peaks: bool) -> str:
        return ", ".join(f"{k.removeprefix('peak_').replace('_', ' ')} {v:.1f} GB/s"
                         for k, v in limits.items() if k.endswith(("thread", "threads"))
                         and k.startswith("peak_") == peaks)

    print(f"{label}: memcpy of 512 MiB back to back for {seconds:.1f} s (as long as a "
          f"phase), the faster of {listed(False)}: {limits['h2d']:.1f} GB/s "
          f"(fastest single copies: {listed(True)})")


class BadArguments(ValueError):
    """An argument combination the benchmark cannot run (exit code 2)."""


def default_l1_bytes(args: argparse.Namespace) -> int:
    return args.l1_size or ((8 << 30) if args.device == "cuda" else (4 << 30))


def several_processes(args: argparse.Namespace) -> bool:
    """Engines in processes of their own (`transfer_engines`), not this one."""
    return args.engines * args.tp > 1 or args.gpus is not None


def check_arguments(args: argparse.Namespace) -> list[Geometry]:
    """The geometries to run; BadArguments for a combination that cannot run."""
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise BadArguments("--device cuda needs a CUDA device")
    if args.gpus is not None and not cuda:
        raise BadArguments("--gpus places engine processes on GPUs: it needs --device cuda")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if args.gpus is not None and visible is None:
        unknown = [g for g in args.gpus if int(g) >= torch.cuda.device_count()]
        if unknown:
            raise BadArguments(f"--gpus names GPUs {unknown}, but this host has "
                               f"{torch.cuda.device_count()} (0..{torch.cuda.device_count() - 1})")
    elif args.gpus is not None:
        # The server inherits this process's CUDA_VISIBLE_DEVICES and must see every
        # engine's GPU to map its memory.
        hidden = [g for g in args.gpus if g not in visible.split(",")]
        if hidden:
            raise BadArguments(f"--gpus names GPUs {hidden} outside CUDA_VISIBLE_DEVICES="
                               f"{visible}, which the server inherits: it could not map their "
                               "memory (--gpus takes the host's indices; unset "
                               "CUDA_VISIBLE_DEVICES or include them)")
    if args.compute_probe and several_processes(args):
        raise BadArguments("--compute-probe runs beside one engine in this process only "
                           "(without --engines, --tp or --gpus)")
    choices = CUDA_GEOMETRIES if cuda else CPU_GEOMETRIES
    geometries = [g for g in choices if not args.geometry or g.name in args.geometry]
    if not geometries:
        raise BadArguments(f"no geometry matches {args.geometry}; choose from "
                           f"{[g.name for g in choices]}")
    l1_bytes = default_l1_bytes(args)
    processes = args.engines * args.tp
    for geometry in geometries:
        # What must stay in the server's memory at once: every process's retrieve set and
        # its stores in flight; more, and stores evict what retrieves are about to read.
        held = (processes * (args.retrieve_set + args.inflight) * args.chunks_per_op
                * geometry.chunk_bytes(CHUNK))
        if held > l1_bytes:
            raise BadArguments(
                f"{geometry.name}: {processes} engine process(es) keep {held / 2**30:.2f} GiB "
                f"in the server at once ((--retrieve-set {args.retrieve_set} + --inflight "
                f"{args.inflight}) operations of {args.chunks_per_op} chunks of "
                f"{geometry.chunk_bytes(CHUNK) / 2**20:.1f} MiB each), more than its "
                f"{l1_bytes / 2**30:.2f} GiB of memory: raise --l1-size or lower --engines, "
                "--tp, --retrieve-set, --inflight or --chunks-per-op")
    return geometries


def start_server(args: argparse.Namespace, l1_bytes: int) -> ServerProcess:
    insecure = ("--insecure",) if args.insecure else ()
    threads = (("--transfer-threads", str(args.transfer_threads))
               if args.transfer_threads else ())
    server = ServerProcess(l1_size=l1_bytes, env={MODE_VARIABLE: args.copy_mode},
                           extra=(*threads, "--cuda-copies", args.cuda_copies,
                                  "--log-level", "WARNING", *insecure),
                           output="inherit").start()
    where = f", CUDA copies in the {args.cuda_copies}" if args.device == "cuda" else ""
    print(f"server: transfer threads {args.transfer_threads or 'its default'}, copy mode "
          f"{args.copy_mode}{where}; "
          f"{args.chunks_per_op} chunks of {CHUNK} tokens per operation, {args.inflight} "
          f"in flight per direction, {args.seconds:.1f} s per phase")
    return server


def run(args: argparse.Namespace) -> int:
    try:
        geometries = check_arguments(args)
    except BadArguments as exc:
        print(f"kvdepot bench transfer: {exc}", file=sys.stderr)
        return 2
    if several_processes(args):
        from kvdepot.bench.transfer_engines import run_engines

        return run_engines(args, geometries)
    cuda = args.device == "cuda"
    limits = cuda_limits() if cuda else cpu_limits(seconds=args.seconds)
    if cuda:
        print(f"device: {torch.cuda.get_device_name()}; limit, page-locked cudaMemcpyAsync of "
              f"1 GiB: H2D {limits['h2d']:.1f} GB/s, D2H {limits['d2h']:.1f} GB/s, both at "
              f"once {limits['both']:.1f} GB/s")
    else:
        print_cpu_limits(limits, args.seconds)
    compute_alone = None
    if cuda and args.compute_probe:
        probe = ComputeProbe()
        probe.start()
        time.sleep(args.seconds)
        compute_alone = probe.stop()
        print(f"matmul probe alone (bf16 8192^3, own process): {compute_alone:.0f} TFLOP/s")
    l1_bytes = default_l1_bytes(args)
    server = start_server(args, l1_bytes)
    results = []
    try:
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
                       "args": arguments_json(args), "results": [asdict(r) for r in results]},
                      f, indent=2)
    return 0


def arguments_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "run"}


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _gpu_list(text: str) -> list[str]:
    gpus = [g.strip() for g in text.split(",")]
    if not all(g.isdigit() for g in gpus):
        raise argparse.ArgumentTypeError(f"expected GPU indices separated by commas (0,1,...), "
                                         f"not {text!r}")
    return gpus


def add_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("transfer", help="store/retrieve bandwidth against the "
                              "host<->device (or memcpy) limit measured in the same run")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--geometry", action="append",
                   help="run only these geometries (repeatable); default all for the device")
    p.add_argument("--seconds", type=float, default=2.0, help="per phase (default %(default)s)")
    p.add_argument("--chunks-per-op", type=_at_least_one, default=8,
                   help="chunks per store/retrieve (default %(default)s: 2,048 tokens, the "
                        "smallest scheduler step vLLM uses by default; 8,192 on H100/H200 "
                        "for `vllm serve`)")
    p.add_argument("--inflight", type=_at_least_one, default=4,
                   help="operations in flight per direction (default %(default)s)")
    p.add_argument("--retrieve-set", type=_at_least_one, default=4,
                   help="operations stored up front for retrieves to read (default %(default)s)")
    p.add_argument("--copy-mode", choices=("auto", "dma", "kernel"), default="auto",
                   help="the server's CUDA copy path (KVDEPOT_CUDA_COPY; default %(default)s)")
    p.add_argument("--cuda-copies", choices=("process", "server"),
                   default=DEFAULTS.cuda_copies,
                   help="where the server queues CUDA copies: a copy process per GPU or its "
                        "own threads (its --cuda-copies; default %(default)s)")
    p.add_argument("--transfer-threads", type=int, default=None,
                   help="the server's transfer threads (default: its own)")
    p.add_argument("--l1-size", type=int, default=None, help="server CPU memory in bytes")
    p.add_argument("--insecure", action="store_true",
                   help="run the server without authentication (to measure what it costs)")
    p.add_argument("--compute-probe", action="store_true",
                   help="also run bf16 matmuls beside the copies and report their rate")
    p.add_argument("--engines", type=_at_least_one, default=1,
                   help="engine processes storing and retrieving at once, each with its own "
                        "registration and KV memory (default %(default)s: this process)")
    p.add_argument("--tp", type=_at_least_one, default=1,
                   help="rank processes per engine (tensor parallelism): each registers as "
                        "one rank of the engine's world (default %(default)s)")
    p.add_argument("--gpus", type=_gpu_list, default=None,
                   help="GPUs for the engine processes, e.g. 0,1,2,3: process i gets "
                        "CUDA_VISIBLE_DEVICES=GPU i modulo their number (default: every "
                        "process on this process's GPU)")
    p.add_argument("--json", help="write every figure to this file")
    p.set_defaults(run=run)
