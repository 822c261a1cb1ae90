"""What the benchmarks share: a real server process, percentiles, machine description."""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from kvdepot.rpc.connection import wait_for_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(chunk_size: int = 256, l1_size: str = "2GiB", extra: tuple[str, ...] = ()
                   ) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real `kvdepot serve` on a free port; yields (url, process)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvdepot.cli", "serve", "--port", str(port), "--chunk-size",
         str(chunk_size), "--l1-size", l1_size, "--log-level", "WARNING", *extra])
    url = f"tcp://127.0.0.1:{port}"
    try:
        wait_for_server(url, 120, proc)
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def percentiles(samples_s: list[float]) -> dict[str, float]:
    """p50/p90/p99/max in milliseconds."""
    a = np.asarray(samples_s) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


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
