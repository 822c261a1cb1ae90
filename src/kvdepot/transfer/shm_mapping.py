"""Engine CPU memory shared with the server through shared-memory files.

The engine side (`kvdepot.client.kv_export`) moves its KV storage into an unlinked
shared-memory file in place (torch swaps the storage's pages, so every existing view
keeps working) and hands the file's descriptor to the server over the handover socket
(`kvdepot.server.handover`). Here the server maps that descriptor. No helper daemon and
no name in /dev/shm: the pages live exactly as long as a mapping in the engine or the
server does.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat

import numpy as np

from kvdepot.errors import InvalidRequest
from kvdepot.transfer.sealed_memory import require_sealed

SharedMapping = tuple[mmap.mmap, np.ndarray]

_SHARED_MEMORY_FILESYSTEMS = {0x01021994: "tmpfs"}
"""statfs f_type of the filesystem memfd_create files live on. Not hugetlbfs: a page
punched out of a hugetlbfs file faults with SIGBUS when no huge page is free, seals or
not."""


def _filesystem_type(fd: int) -> int | None:
    buf = ctypes.create_string_buffer(128)  # struct statfs; f_type is its first field
    if ctypes.CDLL(None, use_errno=True).fstatfs(fd, buf) != 0:
        return None
    return int.from_bytes(buf.raw[:ctypes.sizeof(ctypes.c_long)], "little", signed=True)


def check_shared_fd(fd: int, nbytes: int, what: str = "a handed-over KV memory file") -> None:
    """Refuse anything but an unlinked shared-memory file, open read-write, sealed against
    resizing, that holds `nbytes`: a named file on disk, a device, a pipe, a short file or
    one that could shrink under the server's mapping are all errors."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise InvalidRequest("a handed-over KV memory descriptor is not a regular file")
    fs_type = _filesystem_type(fd)
    if info.st_nlink != 0 or (fs_type is not None and fs_type not in _SHARED_MEMORY_FILESYSTEMS):
        raise InvalidRequest("a handed-over KV memory descriptor is not an unlinked shared-memory "
                             "file (memfd_create)")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise InvalidRequest("a handed-over KV memory descriptor is not open read-write")
    require_sealed(fd, what)
    # Read the size only now: before the seals it could still change.
    size = os.fstat(fd).st_size
    if nbytes <= 0 or size < nbytes:
        raise InvalidRequest(f"{what} holds {size} bytes, fewer than the {nbytes} registered")


def map_shared_fd(fd: int, nbytes: int) -> SharedMapping:
    """Map the first `nbytes` of the engine's file; returns the mapping (keep it alive)
    and a byte view. The descriptor may be closed afterwards."""
    check_shared_fd(fd, nbytes)
    try:
        # Populate the page tables now: faulting 4 KiB pages one by one during copies
        # costs about as much as the copies themselves.
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"cannot map the engine's shared KV memory: {exc}") from exc
    return mapping, np.frombuffer(mapping, dtype=np.uint8)
