"""A chunk held in CPU memory: where its bytes are and who may touch them."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvdepot.keys import ChunkKey


class ChunkScope(NamedTuple):
    """Whose chunk it is: the tenant of the credential that stored it (quotas, fair
    eviction), and the model and cache_salt of its key chain (usage per scope). One
    instance is shared by every chunk of an operation."""

    tenant: str = ""
    model: str = ""
    salt: str = ""


UNSCOPED = ChunkScope()


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
    scope: ChunkScope = UNSCOPED
    parent: bytes | None = None
    """The chain hash of the chunk before it in its prompt, where the writer knew it (KV
    events name it, so a router can link prefixes)."""
    last_use: int = 0
    """When it was last stored, locked or read, on the tier's own clock (LRU across tenants)."""
    lru: Any = None
    """The LRU list of its tenant that holds it while it is READY (the tier's, kept here
    so that touching a chunk costs no lookup of its tenant's list)."""

    @property
    def evictable(self) -> bool:
        return self.state is ChunkState.READY and self.lock_count == 0 and self.pin_count == 0
