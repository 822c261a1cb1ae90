"""A chunk held in CPU memory: where its bytes are and who may touch them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvdepot.keys import ChunkKey


class ChunkState(enum.Enum):
    WRITING = 1
    """Reserved and being filled: invisible to lookups and retrieves, never evicted."""
    READY = 2


@dataclass(slots=True, eq=False)
class Chunk:
    key: ChunkKey
    offset: int
    nbytes: int
    fingerprint: bytes
    """Identifies the KV layout of the bytes; a reader with another layout must not load them."""
    state: ChunkState = ChunkState.WRITING
    lock_count: int = 0
    """Outstanding lookup locks: readers promised that the chunk stays until they retrieve."""
    pin_count: int = 0
    """Copies out of this chunk in progress right now."""

    @property
    def evictable(self) -> bool:
        return self.state is ChunkState.READY and self.lock_count == 0 and self.pin_count == 0
