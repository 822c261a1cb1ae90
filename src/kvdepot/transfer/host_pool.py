"""The CPU pool behind the first tier, one allocation made at start-up, and its mapping in
each GPU's copy process: what the copies move bytes to and from (the tier only carves
chunks out of it)."""

from __future__ import annotations

import logging
import mmap
import os

import torch

log = logging.getLogger(__name__)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_HOST_REGISTER_PORTABLE = 1
"""cudaHostRegisterPortable: page-locked for every CUDA context of the process."""


def allocate_pool(capacity: int) -> torch.Tensor:
    """A flat uint8 tensor of `capacity` bytes, for a server without GPUs (with GPUs the
    pool is `allocate_shared_pool`'s, which each GPU's copy process page-locks).

    Allocated once: chunks are carved out of it, never allocated one by one.
    """
    # Page-aligned, like the engines' shared KV memory it copies to and from: with the
    # two 16 bytes apart modulo 4 KiB (malloc's header), streaming copies from engine
    # memory into the pool ran far slower (probably loads and stores aliasing in their
    # low 12 address bits; docs/benchmarks.md). Populated now, so no copy pays for page
    # faults later.
    memory = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    return torch.frombuffer(memory, dtype=torch.uint8)


def allocate_shared_pool(capacity: int) -> tuple[torch.Tensor, int]:
    """A pool the GPUs' copy processes can map too (`map_shared_pool`): the tensor, and
    the memfd behind it (close-on-exec; handed to each copy process explicitly).

    Not page-locked here: each copy process locks it for its own GPU, and the server
    itself never copies to a GPU then.
    """
    fd = os.memfd_create("kvdepot-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, capacity)
        return map_shared_pool(fd, capacity), fd
    except BaseException:
        os.close(fd)
        raise


def map_shared_pool(fd: int, capacity: int) -> torch.Tensor:
    """The pool's memfd `fd` mapped shared, populated now (in the first process to map
    it, that allocates the pages; later ones only fill in their page tables)."""
    memory = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | _POPULATE)
    return torch.frombuffer(memory, dtype=torch.uint8)


def page_lock(pool: torch.Tensor) -> None:
    """Page-lock an existing mapping for CUDA (cudaHostRegister), so DMAs to and from
    GPUs reach link speed; it stays locked until the process exits."""
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(pool.data_ptr(), pool.numel(), _HOST_REGISTER_PORTABLE)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of the {pool.numel()}-byte pool failed with "
                           f"CUDA error {int(status)}")
