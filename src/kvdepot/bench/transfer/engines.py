"""`kvdepot bench transfer --engines N --tp T [--gpus ...]`: several engine processes
against one server.

Each of the N x T processes (`transfer_engine`) is one rank of one engine, with its own
registration and KV memory on its GPU. Every phase starts in all of them at once (a
barrier: each stores its retrieve set, says so, and only then do all get `run`) and lasts
the same seconds. Figures: each process's, each GPU's (its processes together) beside
that GPU's page-locked limit measured alone, and all processes together beside the limit
of every GPU copying at once (one copy process per GPU, `transfer_limits`, started
together), with the host's memory bandwidth, the server's cores and its operations/s.

An engine process that exits, or stops answering, ends the run with exit code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvdepot.bench.transfer.child_process import Child, ChildFailed, receive_all, send_all
from kvdepot.bench.transfer.engine import EngineConfig
from kvdepot.bench.transfer.limits import DIRECTIONS, GB, cpu_limits
from kvdepot.bench.transfer.load import CHUNK, PHASES, Phase
from kvdepot.bench.transfer.report import (
    GeometryResult,
    arguments_json,
    print_cpu_limits,
    print_geometry,
    rate_parts,
)
from kvdepot.bench.transfer.server import default_l1_bytes, start_server
from kvdepot.testbed.kv_geometry import Geometry
from kvdepot.testbed.server_process import ServerProcess

INHERITED = "default"
"""The GPU of processes started without --gpus: the first of this process's
CUDA_VISIBLE_DEVICES (all of them inherit it)."""
START_TIMEOUT = 600.0
"""Seconds for a process to start (CUDA, KV caches, registration) or warm up."""
REPLY_TIMEOUT = 300.0
"""Seconds beyond a phase's length for every process to report it."""


@dataclass
class EngineRank:
    engine: int
    rank: int
    gpu: str
    """CUDA_VISIBLE_DEVICES for it, or INHERITED."""

    @property
    def label(self) -> str:
        gpu = "" if self.gpu == INHERITED else f" (GPU {self.gpu})"
        return f"engine {self.engine} rank {self.rank}{gpu}"


def plan_processes(args: argparse.Namespace) -> list[EngineRank]:
    """Engine-major: process i = engine i // T, rank i % T, on GPU i modulo the --gpus."""
    gpus = args.gpus or [INHERITED]
    return [EngineRank(i // args.tp, i % args.tp, gpus[i % len(gpus)])
            for i in range(args.engines * args.tp)]


def _gpu_env(gpu: str) -> dict[str, str]:
    return {} if gpu == INHERITED else {"CUDA_VISIBLE_DEVICES": gpu}


# ---- limits -------------------------------------------------------------------------------
def measure_limits(args: argparse.Namespace, gpus: list[str]) -> dict[str, Any]:
    """`host_memory`: cpu_limits(); for CUDA also `per_gpu` (each GPU's page-locked copies
    alone, best of 5 as with one engine) and `all_gpus` (every GPU copying at once, each
    direction sustained for a phase's seconds, summed; `all_gpus_each` the parts)."""
    limits: dict[str, Any] = {"host_memory": cpu_limits(seconds=args.seconds)}
    if args.device != "cuda":
        return limits
    children = [Child(f"the copy process on GPU {gpu}", "kvdepot.bench.transfer.limits", [],
                      _gpu_env(gpu)) for gpu in gpus]
    try:
        receive_all(children, START_TIMEOUT)
        limits["per_gpu"] = {}
        for gpu, child in zip(gpus, children, strict=True):
            child.send({"do": "alone"})
            limits["per_gpu"][gpu] = child.receive(REPLY_TIMEOUT)
        each: dict[str, dict[str, float]] = {gpu: {} for gpu in gpus}
        for direction in DIRECTIONS:
            send_all(children, {"do": direction, "seconds": args.seconds})
            for gpu, reply in zip(gpus, receive_all(children, args.seconds + REPLY_TIMEOUT),
                                  strict=True):
                each[gpu][direction] = reply[direction]
        limits["all_gpus"] = {d: sum(e[d] for e in each.values()) for d in DIRECTIONS}
        limits["all_gpus_each"] = each
    finally:
        for child in children:
            child.stop()
    return limits


def better_limits(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Key by key, the higher of two measurements (nested dicts alike)."""
    return {k: better_limits(v, second[k]) if isinstance(v, dict) else max(v, second[k])
            for k, v in first.items()}


def aggregate_limit(limits: dict[str, Any]) -> dict[str, float]:
    """What all processes together are compared with."""
    return limits.get("all_gpus", limits["host_memory"])


def gpu_limit(limits: dict[str, Any], gpu: str) -> dict[str, float]:
    return limits["per_gpu"][gpu] if "per_gpu" in limits else limits["host_memory"]


def print_limits(limits: dict[str, Any], seconds: float) -> None:
    print_cpu_limits(limits["host_memory"], seconds, "host memory bandwidth")
    if "per_gpu" not in limits:
        return
    for gpu, figures in limits["per_gpu"].items():
        print(f"GPU {gpu}: page-locked cudaMemcpyAsync of 1 GiB alone: H2D "
              f"{figures['h2d']:.1f} GB/s, D2H {figures['d2h']:.1f} GB/s, both at once "
              f"{figures['both']:.1f} GB/s")
    every = limits["all_gpus"]
    print(f"all {len(limits['per_gpu'])} GPU(s) copying at once for {seconds:.1f} s: H2D "
          f"{every['h2d']:.1f} GB/s, D2H {every['d2h']:.1f} GB/s, both {every['both']:.1f} GB/s",
          flush=True)


# ---- the phases ---------------------------------------------------------------------------
@dataclass
class Together:
    """Processes' figures of one phase summed over their common window."""

    processes: int
    seconds: float
    """From the first process's start to the last one's last completion."""
    stored_bytes: int
    retrieved_bytes: int
    store_gbps: float
    retrieve_gbps: float
    stores: int
    retrieves: int
    operations_per_s: float
    errors: int
    engine_cores: float


def together(phases: list[Phase], starts: list[float]) -> Together:
    window = max(s + p.seconds for s, p in zip(starts, phases, strict=True)) - min(starts)
    stored = sum(p.stored_bytes for p in phases)
    retrieved = sum(p.retrieved_bytes for p in phases)
    stores, retrieves = sum(p.stores for p in phases), sum(p.retrieves for p in phases)
    return Together(len(phases), window, stored, retrieved, stored / window / GB,
                    retrieved / window / GB, stores, retrieves, (stores + retrieves) / window,
                    sum(p.errors for p in phases), sum(p.engine_cores for p in phases))


@dataclass
class EnginesPhase:
    name: str
    aggregate: Together
    server_cores: float
    per_gpu: dict[str, Together]
    per_process: list[Phase]


@dataclass
class EnginesResult:
    geometry: GeometryResult
    processes: list[dict[str, Any]]
    """Each process's engine, rank, GPU and pid."""
    phases: list[EnginesPhase] = field(default_factory=list)


def _engine_config(args: argparse.Namespace, server: ServerProcess, geometry: Geometry,
                   process: EngineRank, count: int) -> EngineConfig:
    return EngineConfig(
        server_url=server.url, geometry=geometry.name, device=args.device,
        model=f"bench-{geometry.name}-engine{process.engine}", world_size=args.tp,
        rank=process.rank, seed=1 + process.engine, chunks_per_op=args.chunks_per_op,
        inflight=args.inflight, retrieve_set=args.retrieve_set,
        warm_bytes=default_l1_bytes(args) // count, copy_mode=args.copy_mode)


def run_phase_everywhere(children: list[Child], processes: list[EngineRank],
                         server: ServerProcess, name: str, stores: bool, retrieves: bool,
                         seconds: float) -> EnginesPhase:
    send_all(children, {"do": "prepare", "retrieves": retrieves})
    receive_all(children, START_TIMEOUT)
    cpu0, wall0 = server.cpu_seconds(), time.monotonic()
    send_all(children, {"do": "run", "name": name, "seconds": seconds, "stores": stores,
                        "retrieves": retrieves})
    replies = receive_all(children, seconds + REPLY_TIMEOUT)
    server_cores = (server.cpu_seconds() - cpu0) / (time.monotonic() - wall0)
    phases = [Phase(**r["phase"]) for r in replies]
    starts = [r["started"] for r in replies]
    per_gpu = {}
    for gpu in dict.fromkeys(p.gpu for p in processes):
        mine = [i for i, p in enumerate(processes) if p.gpu == gpu]
        per_gpu[gpu] = together([phases[i] for i in mine], [starts[i] for i in mine])
    return EnginesPhase(name, together(phases, starts), server_cores, per_gpu, phases)


def bench_geometry_engines(geometry: Geometry, server: ServerProcess, args: argparse.Namespace,
                           processes: list[EngineRank], limits: dict[str, Any]) -> EnginesResult:
    children = [Child(p.label, "kvdepot.bench.transfer.engine",
                      [json.dumps(asdict(_engine_config(args, server, geometry, p,
                                                        len(processes))))],
                      _gpu_env(p.gpu)) for p in processes]
    try:
        first = receive_all(children, START_TIMEOUT)[0]
        result = EnginesResult(
            GeometryResult(geometry.name, geometry.description, first["chunk_bytes"] / 2**20,
                           first["copy_path"], first["mean_segment_bytes"] / 1024),
            [{**asdict(p), "pid": c.pid, "label": p.label}
             for p, c in zip(processes, children, strict=True)])
        print_geometry(result.geometry)
        print(f"  {args.engines} engine(s) x {args.tp} rank(s) = {len(processes)} processes "
              f"({first['device']})", flush=True)
        send_all(children, {"do": "warm"})
        warm = sum(Phase(**r).stored_bytes for r in receive_all(children, START_TIMEOUT))
        print(f"  warm-up: stored {warm / GB:.1f} GB once over the server's memory", flush=True)
        for name, stores, retrieves in PHASES:
            phase = run_phase_everywhere(children, processes, server, name, stores, retrieves,
                                         args.seconds)
            result.phases.append(phase)
            print_phase(phase, result, limits, args.device == "cuda")
    finally:
        for child in children:
            child.stop()
    return result


# ---- report -------------------------------------------------------------------------------
def print_phase(phase: EnginesPhase, result: EnginesResult, limits: dict[str, Any], cuda: bool,
                per_process: bool = True) -> None:
    every = phase.aggregate
    errors = f"  {every.errors} LOAD ERRORS" if every.errors else ""
    scope = "all GPUs at once" if cuda else "host memory"
    print(f"  {phase.name:15s} all {every.processes}: "
          + "; ".join(rate_parts(every.store_gbps, every.retrieve_gbps,
                                 aggregate_limit(limits), cuda))
          + f" [limits: {scope}]; {every.operations_per_s:.0f} operations/s; server "
          f"{phase.server_cores:.2f} cores, engines {every.engine_cores:.2f}{errors}")
    if cuda:
        for gpu, figures in phase.per_gpu.items():
            print(f"    GPU {gpu} ({figures.processes}): "
                  + "; ".join(rate_parts(figures.store_gbps, figures.retrieve_gbps,
                                         gpu_limit(limits, gpu), cuda)))
    if not per_process:
        return
    for process, p in zip(result.processes, phase.per_process, strict=True):
        parts = []
        if p.stores:
            parts.append(f"store {p.store_gbps:5.1f} GB/s ({p.stores} ops)")
        if p.retrieves:
            failed = f", {p.errors} FAILED" if p.errors else ""
            parts.append(f"retrieve {p.retrieve_gbps:5.1f} GB/s ({p.retrieves} ops{failed})")
        print(f"      {process['label']}: " + ", ".join(parts or ["nothing moved"])
              + f"; {p.seconds:.2f} s, engine {p.engine_cores:.2f} cores")


def run_engines(args: argparse.Namespace, geometries: list[Geometry]) -> int:
    cuda = args.device == "cuda"
    processes = plan_processes(args)
    gpus = list(dict.fromkeys(p.gpu for p in processes))
    results: list[EnginesResult] = []
    try:
        limits = measure_limits(args, gpus)
        print_limits(limits, args.seconds)
        server = start_server(args, default_l1_bytes(args))
        try:
            for geometry in geometries:
                results.append(bench_geometry_engines(geometry, server, args, processes,
                                                      limits))
        finally:
            server.stop()
        # Measured again at the end, keeping the better figure (as with one engine).
        limits = better_limits(limits, measure_limits(args, gpus))
    except ChildFailed as exc:
        print(f"kvdepot bench transfer: {exc}; the run stops", file=sys.stderr, flush=True)
        return 1
    print("\nsummary; the limits measured again after the run, ratios to the better of the "
          "two:")
    print_limits(limits, args.seconds)
    for result in results:
        print(f"\n{result.geometry.geometry}: {result.geometry.copy_path}")
        for phase in result.phases:
            print_phase(phase, result, limits, cuda, per_process=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "chunk_tokens": CHUNK, "limits": limits,
                       "args": arguments_json(args),
                       "results": [asdict(r) for r in results]}, f, indent=2)
    return 0
