"""Move a CPU tensor storage into a size-sealed memfd, in place.

The server maps the engine's KV memory, and only accepts memory its owner can never
shrink (`kvdepot.transfer.sealed_memory`). torch can move a storage into shared memory
in place (`_share_fd_cpu_`, the pages behind one page-aligned mapping that every view
keeps using), but into a file from shm_open, which cannot be sealed. So: let torch do
that move, copy the bytes into a new sealable memfd, map the memfd over torch's mapping
at the same address (MAP_FIXED: every view, and torch's own bookkeeping, still point at
the same addresses, now backed by the memfd), seal it, and empty torch's file, which
nothing maps any more. torch unmaps the address range when the storage dies, as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

from kvdepot.errors import InvalidRequest
from kvdepot.transfer.sealed_memory import create_sealable, seal_size

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_MAP_FIXED = 0x10
_COPY_STEP = 1 << 30
"""Bytes per pwrite (Linux writes at most about 2 GiB per call)."""


def _copy_into(fd: int, address: int, nbytes: int) -> None:
    view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
    done = 0
    while done < nbytes:
        done += os.pwrite(fd, view[done:done + _COPY_STEP], done)


def _map_over(address: int, nbytes: int, fd: int) -> None:
    got = _libc.mmap(address, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if got != address:
        err = ctypes.get_errno()
        raise InvalidRequest(f"cannot map sealed shared memory over the KV cache: "
                             f"{os.strerror(err)}")


def move_into_sealed_memfd(storage: torch.UntypedStorage) -> tuple[int, int]:
    """Back `storage` by a new size-sealed memfd (contents kept, every view still valid);
    returns the memfd (the caller owns it) and its size."""
    shared_before = storage.is_shared()
    try:
        torch_fd, nbytes = storage._share_fd_cpu_()
    except RuntimeError as exc:
        raise InvalidRequest(f"cannot move the KV cache into shared memory: {exc}") from exc
    if shared_before and os.fstat(torch_fd).st_size:
        # Emptied torch files are ours (moved before, e.g. a registration being retried):
        # moving again is safe. Any other shared storage may be mapped by another process,
        # which would no longer see the engine's writes.
        raise InvalidRequest("a CPU KV cache tensor is already in shared memory (another "
                             "process may map it); kvdepot must move it itself, so register "
                             "tensors that were never shared")
    address = storage.data_ptr()
    if address % mmap.PAGESIZE:
        raise InvalidRequest("torch's shared mapping of the KV cache is not page-aligned")
    fd = create_sealable("kvdepot-kv", nbytes)
    try:
        _copy_into(fd, address, nbytes)
        _map_over(address, nbytes, fd)
        seal_size(fd)
    except BaseException:
        os.close(fd)
        raise
    # Nothing maps torch's file any more (torch keeps its descriptor until the storage
    # dies): give its pages back now rather than hold the cache twice.
    os.ftruncate(torch_fd, 0)
    return fd, nbytes
