"""What the benchmarks share: a real server process, percentiles, machine description."""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from kvdepot.server_process import ServerProcess


@contextmanager
def server_process(chunk_size: int = 256, l1_size: str = "2GiB", extra: tuple[str, ...] = ()
                   ) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real `kvdepot serve` on a free port, printing its warnings here; yields (url,
    process)."""
    server = ServerProcess(chunk_size=chunk_size, l1_size=l1_size,
                           extra=("--log-level", "WARNING", *extra), output="inherit")
    with server:
        assert server.proc is not None
        yield server.url, server.proc


def percentiles(samples_s: list[float]) -> dict[str, float]:
    """p50/p90/p99/max in milliseconds."""
    a = np.asarray(samples_s) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"
