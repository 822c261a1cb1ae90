"""One thread per GPU that queues every copy the server makes on that GPU.

Queueing a staged operation takes a few dozen torch calls, and torch lets go of the
interpreter lock inside most of them. When several transfer threads queued at once, each
of those calls handed the lock to another thread and waited to get it back, which made
every call several times slower than from one thread (measured in docs/benchmarks.md).
So transfer threads keep the work that is not CUDA (validation, the tier, the fence) and
hand each operation's queueing to this thread, which alone talks to the GPU; they wait
for the copies themselves, outside it, so it never idles while a copy runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

_threads: dict[int, ThreadPoolExecutor] = {}
_threads_lock = threading.Lock()


def _bind(index: int) -> None:
    # The CUDA runtime's current device is per thread: set once, no per-call switching.
    torch.cuda.set_device(index)


def run_on_device_thread(device: torch.device, job: Callable[[], T]) -> T:
    """Runs `job` on `device`'s submission thread (started on first use) and returns its
    result or raises its exception."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    executor = _threads.get(index)
    if executor is None:
        with _threads_lock:
            executor = _threads.get(index)
            if executor is None:
                executor = _threads[index] = ThreadPoolExecutor(
                    1, thread_name_prefix=f"kvdepot-cuda{index}", initializer=_bind,
                    initargs=(index,))
    return executor.submit(job).result()
