"""Engine CPU memory shared with the server through POSIX shared memory.

The engine side (`kvdepot.client.kv_export`) moves its KV storage into an unlinked
shared-memory file in place (torch swaps the storage's pages, so every existing view
keeps working) and sends its pid and file descriptor. The server opens the same file
through /proc and maps it. No helper daemon and no name in /dev/shm: the pages live
exactly as long as a mapping in the engine or the server does. The server must run in
the engine's PID namespace (same host, or a container sharing it).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvdepot.errors import InvalidRequest
from kvdepot.protocol import SharedCPUMemory


def open_shared_file(handle: SharedCPUMemory) -> int:
    """A read-write descriptor of the engine's shared-memory file (the caller closes it)."""
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidRequest(
            f"cannot map the engine's shared KV memory at {path}: {exc}. The server must run "
            "on the engine's machine, in its PID namespace, as the same user (or root)"
        ) from exc


def open_shared_cpu(handle: SharedCPUMemory) -> tuple[mmap.mmap, np.ndarray]:
    """Map the engine's allocation; returns the mapping (keep it alive) and a byte view."""
    fd = open_shared_file(handle)
    try:
        # Populate the page tables now: faulting 4 KiB pages one by one during copies
        # costs about as much as the copies themselves.
        mapping = mmap.mmap(fd, handle.nbytes,
                            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"cannot map the engine's shared KV memory: {exc}") from exc
    finally:
        os.close(fd)
    return mapping, np.frombuffer(mapping, dtype=np.uint8)
