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


_MADV_POPULATE_WRITE = 23
"""madvise(2) advice (Linux 5.14): fault the range in for writing, as the copies will.
Python's mmap module does not name it."""
MAX_POPULATE_RUNS = 4096
"""Runs of written pages populated one madvise each; a file written in more pieces than
that (no engine writes its KV cache so) has the rest faulted in by the copies, so a
registration cannot make the control thread issue a syscall per page."""
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _allocated_bytes(fd: int) -> tuple[int, int]:
    """(bytes tmpfs holds for the file, the file's size rounded up to whole pages)."""
    info = os.fstat(fd)
    page = mmap.PAGESIZE
    return info.st_blocks * 512, (info.st_size + page - 1) // page * page


def _resident_runs(mapping: mmap.mmap, nbytes: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Page ranges [start, end) of the mapping whose pages the file holds (mincore(2) reports
    a shared file mapping's page cache, which for tmpfs is the file's memory); None if the
    kernel would not tell."""
    pages = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = np.zeros(pages, dtype=np.uint8)
    anchor = ctypes.c_char.from_buffer(mapping)  # the address; dropped before returning
    try:
        failed = _libc.mincore(ctypes.addressof(anchor), nbytes, vector.ctypes.data) != 0
    finally:
        del anchor
    if failed:
        return None
    edges = np.diff(np.concatenate(([0], vector & 1, [0])).astype(np.int8))
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


def _populate(mapping: mmap.mmap, start: int, length: int) -> bool:
    """Fault `length` bytes at `start` in for writing; False if the kernel lacks
    MADV_POPULATE_WRITE (the copies then fault pages in as they touch them)."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE, start, length)
    except OSError:
        return False
    return True


def populate_written(mapping: mmap.mmap, fd: int, nbytes: int) -> int:
    """Fill the page tables of the first `nbytes` of `mapping` (of `fd`) where the engine
    wrote, and nowhere else; returns the bytes populated.

    Why not MAP_POPULATE: it faults in every page of the range, and tmpfs allocates a page
    for a read fault in a hole, so a tenant that registered a file it never wrote made the
    server allocate all of it (2 GiB of host memory per 2 GiB registration). Populating
    still pays: faulting 4 KiB pages one by one during the first copies costs about as
    much as the copies. tmpfs reports what it holds for the file (st_blocks): a file held
    whole (the worker copied its cache into it) is populated in one call, an empty one not
    at all, anything between where mincore(2) says the file has pages. A hole punched
    between the check and the populate is filled, within the registration's bound
    (`EngineRegistry`), like any page the engine's copies would touch."""
    if nbytes <= 0:
        return 0
    held, whole = _allocated_bytes(fd)
    if held == 0:
        return 0
    if held >= whole:
        return nbytes if _populate(mapping, 0, nbytes) else 0
    runs = _resident_runs(mapping, nbytes)
    if runs is None:
        return 0
    starts, ends = runs
    page = mmap.PAGESIZE
    if int((ends - starts).sum()) * page > held:
        # mincore reports every page resident when it may not look (a file of another
        # owner whose mode forbids writing it, for a server without CAP_FOWNER): it
        # contradicts what tmpfs holds, so believe neither and populate nothing.
        return 0
    populated = 0
    for start, end in zip(starts[:MAX_POPULATE_RUNS].tolist(), ends[:MAX_POPULATE_RUNS].tolist(),
                          strict=True):
        length = min(end * page, nbytes) - start * page
        if not _populate(mapping, start * page, length):
            break
        populated += length
    return populated


def map_shared_fd(fd: int, nbytes: int) -> SharedMapping:
    """Map the first `nbytes` of the engine's file; returns the mapping (keep it alive)
    and a byte view. The descriptor may be closed afterwards. Only pages the engine wrote
    are populated (`populate_written`): mapping costs no memory the file does not hold."""
    check_shared_fd(fd, nbytes)
    try:
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"cannot map the engine's shared KV memory: {exc}") from exc
    populate_written(mapping, fd, nbytes)
    return mapping, np.frombuffer(mapping, dtype=np.uint8)
