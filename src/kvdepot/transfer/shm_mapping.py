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

import numpy as np

from kvdepot.errors import InvalidRequest
from kvdepot.protocol import SharedCPUMemory


def open_shared_cpu(handle: SharedCPUMemory) -> tuple[mmap.mmap, np.ndarray]:
    """Map the engine's allocation; returns the mapping (keep it alive) and a byte view."""
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        with open(path, "r+b") as f:
            # Populate the page tables now: faulting 4 KiB pages one by one during copies
            # costs about as much as the copies themselves.
            mapping = mmap.mmap(f.fileno(), handle.nbytes,
                                flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except (OSError, ValueError) as exc:
        raise InvalidRequest(
            f"cannot map the engine's shared KV memory at {path}: {exc}. The server must run "
            "on the engine's machine, in its PID namespace, as the same user (or root)"
        ) from exc
    return mapping, np.frombuffer(mapping, dtype=np.uint8)
