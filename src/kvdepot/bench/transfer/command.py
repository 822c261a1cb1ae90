"""`kvdepot bench transfer`: store and retrieve bandwidth through a real server.

Starts `kvdepot serve` as its own process, registers a KV cache of a real model geometry
from this process (the engine) through the seed-compatible worker adapter, and keeps
several stores and/or retrieves in flight for a few seconds per phase: stores alone,
retrieves alone, both together. Each figure is printed beside the physical limit
measured in the same run (page-locked cudaMemcpyAsync for `--device cuda`, a plain
large memory copy for `--device cpu`; `transfer_limits`), with the server process's CPU
use in cores. With `--engines`, `--tp` or `--gpus` the engines are processes of their own
(`transfer_engines`). The load an engine puts on the server is `transfer_load`'s, the
server `transfer_server`'s and the printed figures `transfer_report`'s, which both this
module and `transfer_engines` import.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

import torch

from kvdepot.bench.transfer.limits import GB, cpu_limits, cuda_limits
from kvdepot.bench.transfer.load import (
    CHUNK,
    COMPUTE_PHASE,
    PHASES,
    ComputeProbe,
    Load,
    build_engine_kv,
    register_engine,
    run_phase,
    warm_up,
)
from kvdepot.bench.transfer.report import (
    GeometryResult,
    arguments_json,
    print_cpu_limits,
    print_geometry,
    print_result,
)
from kvdepot.bench.transfer.server import default_l1_bytes, start_server
from kvdepot.testbed.kv_geometry import CPU_GEOMETRIES, CUDA_GEOMETRIES, Geometry
from kvdepot.testbed.server_process import ServerProcess
from kvdepot.transfer.cuda_copier import MODES


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


class BadArguments(ValueError):
    """An argument combination the benchmark cannot run (exit code 2)."""


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


def run(args: argparse.Namespace) -> int:
    try:
        geometries = check_arguments(args)
    except BadArguments as exc:
        print(f"kvdepot bench transfer: {exc}", file=sys.stderr)
        return 2
    if several_processes(args):
        from kvdepot.bench.transfer.engines import run_engines

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
            print_result(result, limits, compute_alone, cuda)
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
        print_result(result, limits, compute_alone, cuda)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "limits": limits, "compute_alone": compute_alone,
                       "args": arguments_json(args), "results": [asdict(r) for r in results]},
                      f, indent=2)
    return 0


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
    p.add_argument("--copy-mode", choices=MODES, default="auto",
                   help="the server's CUDA copy path (KVDEPOT_CUDA_COPY; default %(default)s)")
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
