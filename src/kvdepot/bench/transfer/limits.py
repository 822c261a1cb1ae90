"""The physical limits `kvdepot bench transfer` prints its figures beside.

`cuda_limits`: page-locked cudaMemcpyAsync on this process's GPU, each direction alone and
both at once. `cpu_limits`: the host's memory-copy bandwidth. Run as a module
(`python -m kvdepot.bench.transfer.limits`), this is one GPU's copy process for the
several-engine benchmark (`transfer_engines`): it answers `alone` with `cuda_limits()`,
and `h2d`, `d2h`, `both` with copies sustained for a given number of seconds, which the
parent starts on every GPU at once to measure what all of them move together.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvdepot.bench.transfer.child_process import ParentChannel
from kvdepot.options import default_transfer_threads

GB = 1e9
DIRECTIONS = ("h2d", "d2h", "both")


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


class CudaCopies:
    """Page-locked host buffers and device buffers of `nbytes` each, two of both, and
    the copies between them, each direction alone or both at once on two streams."""

    def __init__(self, nbytes: int = 1 << 30) -> None:
        self.nbytes = nbytes
        self.host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def h2d(self) -> None:
        self.dev[0].copy_(self.host[0], non_blocking=True)

    def d2h(self) -> None:
        self.host[0].copy_(self.dev[0], non_blocking=True)

    def both(self) -> None:
        with torch.cuda.stream(self.streams[0]):
            self.dev[0].copy_(self.host[0], non_blocking=True)
        with torch.cuda.stream(self.streams[1]):
            self.host[1].copy_(self.dev[1], non_blocking=True)

    def bytes_per_run(self, direction: str) -> int:
        return 2 * self.nbytes if direction == "both" else self.nbytes

    def best(self, direction: str, repeats: int = 5) -> float:
        """GB/s of the fastest of `repeats` runs."""
        return _timed(getattr(self, direction), self.bytes_per_run(direction), repeats,
                      torch.cuda.synchronize)

    def sustained(self, direction: str, seconds: float) -> float:
        """GB/s of runs back to back for `seconds` (each run waited for)."""
        fn = getattr(self, direction)
        fn()
        torch.cuda.synchronize()
        runs = 0
        start = end = time.perf_counter()
        while end - start < seconds:
            fn()
            torch.cuda.synchronize()
            runs, end = runs + 1, time.perf_counter()
        return runs * self.bytes_per_run(direction) / (end - start) / GB


def cuda_limits(nbytes: int = 1 << 30) -> dict[str, float]:
    """Page-locked cudaMemcpyAsync H2D, D2H, and both at once on two streams (best of 5)."""
    copies = CudaCopies(nbytes)
    return {direction: copies.best(direction) for direction in DIRECTIONS}


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
    threads = threads or default_transfer_threads(False)
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


def main() -> int:
    """One GPU's copy process: `{"do": "alone"}` -> cuda_limits(); `{"do": DIRECTION,
    "seconds": S}` -> {DIRECTION: GB/s sustained}; `{"do": "exit"}` ends it."""
    channel = ParentChannel()
    copies = CudaCopies()
    channel.send({"ready": True, "gpu": torch.cuda.get_device_name()})
    while True:
        command = channel.receive()
        if command is None or command["do"] == "exit":
            return 0
        if command["do"] == "alone":
            channel.send({d: copies.best(d) for d in DIRECTIONS})
        else:
            channel.send({command["do"]: copies.sustained(command["do"], command["seconds"])})


if __name__ == "__main__":
    sys.exit(main())
