"""KV caches in driver-mapped memory, allocated the way vLLM 0.34's extensible KV cache
allocates them: one reserved address range, one physical allocation per layer segment
(cuMemCreate with POSIX-descriptor handles, or with none as vLLM's sleep-mode
CuMemAllocator before 0.34 did), each mapped at its segment with read-write access, and
each layer a FlashAttention `[2, blocks, block, heads, head_dim]` view whose storage spans
exactly its segment's used bytes (made from a pointer, as vLLM makes them through DLPack).
"""

from __future__ import annotations

import torch

from kvdepot.transfer.address_span import raw_byte_view
from kvdepot.transfer.cuda_driver import (
    CU_MEM_HANDLE_TYPE_NONE,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    cuda_driver,
)
from tests.gpu.support.kv_layouts import BLOCK, DTYPE, HEAD_DIM, HEADS, LAYERS

POSIX_FD = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
NO_EXPORT = CU_MEM_HANDLE_TYPE_NONE


class DriverMappedKV:
    """`layers` FlashAttention layers of `num_blocks` blocks in driver-mapped memory.

    `per_allocation` layers share each physical allocation (1: vLLM 0.34's one per
    segment; 2: a second storage starting inside an allocation); `handle_types` is what
    cuMemCreate is asked to make exportable. `free` gives everything back."""

    def __init__(self, num_blocks: int, device: torch.device, handle_types: int = POSIX_FD,
                 layers: int = LAYERS, per_allocation: int = 1) -> None:
        self.device = device
        index = device.index if device.index is not None else 0
        driver = cuda_driver()
        driver.ensure_context(index)
        granule = driver.granularity(index)
        self.layer_bytes = 2 * num_blocks * BLOCK * HEADS * HEAD_DIM * DTYPE.itemsize
        used = per_allocation * self.layer_bytes
        self.allocation_bytes = -(-used // granule) * granule
        allocations = -(-layers // per_allocation)
        self.reserved = allocations * self.allocation_bytes
        self.base = driver.reserve(self.reserved, granule)
        self.mapped: list[int] = []
        self.caches: dict[str, torch.Tensor] = {}
        try:
            for a in range(allocations):
                handle = driver.create(self.allocation_bytes, index, handle_types)
                at = self.base + a * self.allocation_bytes
                try:
                    driver.map(at, self.allocation_bytes, handle)
                finally:
                    driver.release(handle)  # the mapping keeps the memory
                self.mapped.append(at)
                driver.set_access(at, self.allocation_bytes, index)
            for i in range(layers):
                at = self.base + (i // per_allocation) * self.allocation_bytes \
                    + (i % per_allocation) * self.layer_bytes
                raw = raw_byte_view(at, self.layer_bytes, device)
                self.caches[f"layers.{i}.attn"] = raw.view(DTYPE).view(
                    2, num_blocks, BLOCK, HEADS, HEAD_DIM)
        except BaseException:
            self.free()
            raise

    def free(self) -> None:
        """Drop the views, unmap, free the range: the memory goes back to the driver once
        no other process maps or holds it."""
        torch.cuda.synchronize(self.device)
        self.caches.clear()
        driver = cuda_driver()
        for at in self.mapped:
            driver.unmap(at, self.allocation_bytes)
        self.mapped = []
        if self.base:
            driver.free_address(self.base, self.reserved)
            self.base = 0
