"""The CPU memory behind the first tier: one allocation made at start-up."""

from __future__ import annotations

import logging

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
    return torch.empty(capacity, dtype=torch.uint8)
