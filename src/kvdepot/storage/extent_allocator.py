"""First-fit allocation of byte ranges inside one fixed buffer.

Chunks of one deployment mostly have one size, so freeing a chunk leaves a hole that
the next chunk fits exactly; first fit with coalescing keeps fragmentation low without
size classes.
"""

from __future__ import annotations

import bisect


class ExtentAllocator:
    def __init__(self, capacity: int, alignment: int = 4096) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self._starts: list[int] = [0]  # sorted starts of free extents
        self._sizes: dict[int, int] = {0: self.capacity}
        self.allocated_bytes = 0

    def aligned(self, nbytes: int) -> int:
        return -(-nbytes // self.alignment) * self.alignment

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a free range of at least `nbytes`, or None if no hole is big enough."""
        size = self.aligned(nbytes)
        for i, start in enumerate(self._starts):
            free = self._sizes[start]
            if free < size:
                continue
            del self._sizes[start]
            if free == size:
                del self._starts[i]
            else:
                self._starts[i] = start + size
                self._sizes[start + size] = free - size
            self.allocated_bytes += size
            return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        size = self.aligned(nbytes)
        self.allocated_bytes -= size
        i = bisect.bisect_left(self._starts, offset)
        # Merge with the following extent, then with the preceding one.
        if i < len(self._starts) and self._starts[i] == offset + size:
            size += self._sizes.pop(self._starts[i])
            del self._starts[i]
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] == offset:
                self._sizes[prev] += size
                return
        self._starts.insert(i, offset)
        self._sizes[offset] = size

    @property
    def largest_free(self) -> int:
        return max(self._sizes.values(), default=0)
