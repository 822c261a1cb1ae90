"""A bf16 matrix-product loop in its own process, to measure what copies take from compute.

Own process, so the benchmark's Python threads cannot slow it down through the GIL.
Protocol on stdin/stdout: prints `ready` once warm; runs products from `go` to `stop`,
then prints the rate in TFLOP/s.
"""

from __future__ import annotations

import sys
import threading
import time

import torch


def main() -> int:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    done = 0
    start = time.perf_counter()
    while not stop.is_set():
        for _ in range(4):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        done += 4
    elapsed = time.perf_counter() - start
    print(f"{done * 2 * n ** 3 / elapsed / 1e12:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
