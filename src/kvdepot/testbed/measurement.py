"""What the benchmarks share: a real server process, a fresh process for a vLLM engine,
percentiles, machine description."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import platform
import queue
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvdepot.testbed.server_process import ServerProcess


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


def in_spawned_process(target: Callable[..., None], *args: Any,
                       timeout: float | None = None) -> Any:
    """Run `target(*args, out)` in a fresh (spawned) process and return what it put on
    `out`: a vLLM engine each time, whose state and threads do not outlive the run. An
    error in the child is printed there and raised here once it has exited. With
    `timeout`: TimeoutError once that many seconds have passed, the process and every
    process under it (vLLM's engine core) stopped first, so none goes on holding the GPU."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, out))
    proc.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        alive = proc.is_alive()  # before the wait, so a result put just before exit is read
        try:
            result = out.get(timeout=1)
            break
        except queue.Empty:
            if not alive:
                raise RuntimeError(f"the engine process failed (exit status {proc.exitcode}); "
                                   "its error is printed above") from None
            if deadline is not None and time.monotonic() > deadline:
                stop_process_tree(proc.pid)
                proc.join(10)
                raise TimeoutError(f"the engine did not finish within {timeout:g} s; it was "
                                   "stopped") from None
    proc.join(120)
    return result


def stop_process_tree(pid: int) -> None:
    """Stop a process and every process under it: SIGTERM, then SIGKILL for any still
    there 15 s later."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [*root.children(recursive=True), root]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=10)


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
