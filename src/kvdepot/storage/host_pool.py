"""The CPU memory behind the first tier: one allocation made at start-up."""

from __future__ import annotations

import logging
import mmap

import torch

log = logging.getLogger(__name__)


def allocate_pool(capacity: int, pin: bool | None = None) -> torch.Tensor:
    """A flat uint8 tensor of `capacity` bytes.

    Page-locked when CUDA is present (DMA to and from GPUs needs it to reach link speed),
    plain otherwise. Allocated once: chunks are carved out of it, never allocated one by one.
    """
    if pin is None:
        pin = torch.cuda.is_available()
    if pin:
        return torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
    # Page-aligned, like the engines' shared KV memory it copies to and from: with the
    # two 16 bytes apart modulo 4 KiB (malloc's header), streaming copies from engine
    # memory into the pool ran far slower (probably loads and stores aliasing in their
    # low 12 address bits; docs/benchmarks.md). Populated now, so no copy pays for page
    # faults later.
    memory = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                       | getattr(mmap, "MAP_POPULATE", 0))
    return torch.frombuffer(memory, dtype=torch.uint8)
