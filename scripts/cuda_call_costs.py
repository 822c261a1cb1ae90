"""Host cost of each CUDA call a staged copy makes, from one thread and from four at once.

Diagnoses the server's per-operation host work (docs/benchmarks.md, several engines on
one GPU): torch releases the interpreter lock inside most CUDA calls, so threads that
call at the same time hand it to each other on every call. Needs a CUDA device:

    python scripts/cuda_call_costs.py
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

CALLS = 3000
IPC_EVENTS = 600
"""Interprocess events the helper process exports (the driver runs out of them in the
low thousands)."""


def export_events(conn: Connection, count: int) -> None:
    """Creates and records `count` interprocess events and sends their handles."""
    torch.cuda.init()
    events = []
    start = time.perf_counter()
    for _ in range(count):
        event = torch.cuda.Event(interprocess=True)
        event.record()
        events.append(event)
    handles = [bytes(e.ipc_handle()) for e in events]
    conn.send((handles, time.perf_counter() - start))
    conn.recv()  # keeps the events alive until the other side has opened them


def measure(name: str, call: Callable[[], None], calls: int = CALLS, threads: int = 1) -> None:
    def loop() -> None:
        for _ in range(calls):
            call()

    loop()  # warm-up
    torch.cuda.synchronize()
    workers = [threading.Thread(target=loop) for _ in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"{name:40s} threads {threads}: {seconds / (calls * threads) * 1e6:8.2f} us/call",
          flush=True)


def main() -> None:
    device = torch.device("cuda")
    torch.cuda.init()
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    exporter = ctx.Process(target=export_events, args=(theirs, IPC_EVENTS))
    exporter.start()
    if ours.poll(60):
        handles, seconds = ours.recv()
        print(f"interprocess Event()+record+ipc_handle (exporter): "
              f"{seconds / len(handles) * 1e6:.2f} us each")
        remaining = iter(handles)
        stream = torch.cuda.Stream()

        def open_and_wait() -> None:
            stream.wait_event(torch.cuda.Event.from_ipc_handle(device, next(remaining)))

        # Warm-up plus measurement take 2 * calls * threads handles.
        measure("from_ipc_handle+wait_event", open_and_wait, calls=IPC_EVENTS // 4, threads=1)
        measure("from_ipc_handle+wait_event", open_and_wait, calls=IPC_EVENTS // 20, threads=4)
        ours.send(None)
    else:
        print("the event exporter did not answer")
    exporter.join(10)

    pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    staging = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    rows = torch.empty((4096, 4096), dtype=torch.int64, device=device)
    out = torch.empty((64, 4096), dtype=torch.int64, device=device)
    index = torch.randint(0, 4096, (64,), device=device)
    finished = torch.cuda.Event()
    finished.record()
    finished.synchronize()
    streams = [torch.cuda.Stream() for _ in range(8)]
    mine = threading.local()

    def stream() -> torch.cuda.Stream:
        if not hasattr(mine, "stream"):
            mine.stream = streams[threading.get_ident() % len(streams)]
        return mine.stream

    def record() -> None:
        torch.cuda.Event().record(stream())

    def small_copy() -> None:
        staging[:4096].copy_(pinned[:4096], non_blocking=True)

    def small_copy_in_context() -> None:
        with torch.cuda.stream(stream()):
            staging[:4096].copy_(pinned[:4096], non_blocking=True)

    def gather_in_context() -> None:
        with torch.cuda.stream(stream()):
            torch.index_select(rows, 0, index, out=out)

    def stream_context() -> None:
        with torch.cuda.stream(stream()):
            pass

    def device_context() -> None:
        with torch.cuda.device(device):
            pass

    calls = [("Event()+record", record),
             ("cudaMemcpyAsync 4 KiB", small_copy),
             ("cudaMemcpyAsync 4 KiB in stream context", small_copy_in_context),
             ("index_select in stream context", gather_in_context),
             ("stream.wait_event", lambda: stream().wait_event(finished)),
             ("event.synchronize (finished)", finished.synchronize),
             ("with torch.cuda.device", device_context),
             ("with torch.cuda.stream", stream_context),
             ("tensor slice", lambda: pinned[:4096])]
    for threads in (1, 4):
        for name, call in calls:
            measure(name, call, threads=threads)


if __name__ == "__main__":
    main()
