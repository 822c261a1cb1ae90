"""What `kvdepot bench transfer` prints and writes: each geometry's figures beside the
limits measured in the same run, by the command with one engine (`transfer`) and with
several (`transfer_engines`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from kvdepot.bench.transfer.load import Phase


@dataclass
class GeometryResult:
    geometry: str
    description: str
    chunk_mib: float
    copy_path: str
    mean_segment_kib: float
    phases: list[Phase] = field(default_factory=list)


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


def print_result(result: GeometryResult, limits: dict[str, float], compute_alone: float | None,
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


def arguments_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "run"}
