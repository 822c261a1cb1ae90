"""What a second process's store copies cost an engine that keeps the GPU busy.

Two processes on one GPU, as an engine and kvdepot's server are: the "engine" runs
back-to-back bfloat16 GEMMs of an 8B model's MLP size and times them; the "server"
meanwhile stores 64 MiB every `--period-ms` (the rate at which a batch of distinct
2,048-token prompts fills kvdepot) in one of these ways:

    none        nothing (the engine alone)
    gather:M    one gather kernel of M MiB of 32 KiB rows into a staging buffer, then one
                DMA to pinned host memory (what the server does for vLLM's flash-attention
                layout, M = 64)
    dma:M       one M MiB DMA from device memory (no kernel)
    dma_rows:M  one DMA per 32 KiB row (no kernel)
    batch:M     the rows in one cuMemcpyBatchAsync (no kernel), as the server stores
(each at the same rate in bytes: an M MiB store every M / 64 periods).

Kernels of two processes do not run at the same time: the GPU switches between their
contexts. DMAs run on copy engines. Prints the engine's time per scenario against running
alone, and the server's time per store. Needs a CUDA device:

    python scripts/gpu_contention.py [--period-ms 13] [--gemms 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np
import torch

from kvdepot.transfer.cuda_driver import cuda_driver

ROW = 32 << 10
SCENARIOS = ("none", "gather:64", "gather:8", "gather:256", "dma:64", "dma_rows:64",
             "batch:64", "batch:8", "batch:256")


def server(todo: mp.Queue, done: mp.Queue, stop: mp.Event, period_s: float) -> None:
    device = torch.device("cuda")
    rows = (2 << 30) // ROW
    source = torch.randint(0, 255, ((2 << 30),), dtype=torch.uint8, device=device)
    source_rows = source.view(torch.int64).view(rows, ROW // 8)
    staging = torch.empty(((256 << 20) // 8,), dtype=torch.int64, device=device)
    host = torch.empty(((256 << 20) // 8,), dtype=torch.int64, pin_memory=True)
    stream = torch.cuda.Stream()
    driver = cuda_driver()
    while True:
        scenario = todo.get()
        if scenario is None:
            return
        kind, _, mib = scenario.partition(":")
        size = int(mib or 64) << 20
        every = period_s * size / (64 << 20)
        n = size // ROW
        index = torch.randperm(rows, device=device)[:n]
        picks = index.tolist()
        srcs = np.array([source_rows[r].data_ptr() for r in picks], dtype=np.uint64)
        dsts = host.data_ptr() + np.arange(n, dtype=np.uint64) * ROW
        sizes = np.full(n, ROW, dtype=np.uint64)
        torch.cuda.synchronize()
        done.put("ready")
        times: list[float] = []
        next_at = time.perf_counter()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                now = time.perf_counter()
                if now < next_at:
                    time.sleep(min(next_at - now, 0.002))
                    continue
                next_at += every
                if kind == "none":
                    continue
                began = time.perf_counter()
                out = staging[: size // 8]
                if kind == "gather":
                    torch.index_select(source_rows, 0, index, out=out.view(n, ROW // 8))
                    host[: size // 8].copy_(out, non_blocking=True)
                elif kind == "dma":
                    host[: size // 8].copy_(source[: size].view(torch.int64), non_blocking=True)
                elif kind == "batch":
                    driver.copy_batch(dsts, srcs, sizes, stream.cuda_stream)
                else:
                    hrows = host[: size // 8].view(n, ROW // 8)
                    for i, r in enumerate(picks):
                        hrows[i].copy_(source_rows[r], non_blocking=True)
                stream.synchronize()
                times.append(time.perf_counter() - began)
        done.put((len(times), statistics.median(times) if times else 0.0))


def engine_ms(a: torch.Tensor, b: torch.Tensor, gemms: int) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(gemms):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--period-ms", type=float, default=13.0)
    p.add_argument("--gemms", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scenarios", default=" ".join(SCENARIOS))
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    todo, done, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=server, args=(todo, done, stop, args.period_ms / 1e3))
    proc.start()
    a = torch.randn(8192, 4096, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(4096, 14336, dtype=torch.bfloat16, device="cuda")
    engine_ms(a, b, 50)
    print(f"{torch.cuda.get_device_name()}; {args.gemms} GEMMs [8192x4096]x[4096x14336] "
          f"bf16; a store of 64 MiB every {args.period_ms} ms", flush=True)
    base = None
    for scenario in args.scenarios.split():
        runs, stores, per_store = [], 0, []
        for _ in range(args.repeats):
            stop.clear()
            todo.put(scenario)
            assert done.get() == "ready"
            runs.append(engine_ms(a, b, args.gemms))
            stop.set()
            count, median_s = done.get()
            stores += count
            per_store.append(median_s)
        ms = statistics.median(runs)
        base = ms if scenario == "none" else base
        lost = "" if base is None or scenario == "none" else (
            f", +{ms - base:.1f} ms ({ms / base - 1:+.2%}); "
            f"{(ms - base) / max(stores / args.repeats, 1) * 1e3:.0f} us per store")
        print(f"{scenario:>10}: engine {ms:.1f} ms (runs {', '.join(f'{r:.1f}' for r in runs)})"
              f"{lost}; {stores / args.repeats:.0f} stores per run, each "
              f"{statistics.median(per_store) * 1e3:.2f} ms", flush=True)
    todo.put(None)
    proc.join()


if __name__ == "__main__":
    main()
