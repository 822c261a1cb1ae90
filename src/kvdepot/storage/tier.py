"""The interface of the tiers below CPU memory (local disk, Redis/Valkey).

The CPU memory tier (`CPUTier`) is where every copy to or from an engine happens;
a lower tier only ever exchanges whole chunks with it. Lookups that reach a lower
tier are answered asynchronously: the server brings the chunks up into CPU memory
in the background, and QUERY_PREFETCH_STATUS reports None until they are there.
Every method may do I/O and is never called on the control thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from kvdepot.keys import ChunkKey
from kvdepot.storage.chunk import ChunkScope


class TierListener(Protocol):
    """Told of every chunk that enters or leaves a tier (the KV events), under the tier's
    own mutex so that what it hears is in the tier's order: it must never block."""

    def stored(self, tier: str, key: ChunkKey, scope: ChunkScope, parent: bytes | None
               ) -> None: ...

    def removed(self, tier: str, chunks: list[tuple[ChunkKey, str]]) -> None:
        """(key, tenant) of each chunk that left `tier`."""


class LowerTier(ABC):
    @abstractmethod
    def stored_size(self, key: ChunkKey) -> int | None:
        """The chunk's size in bytes if the tier holds it (a read may still fail)."""

    @abstractmethod
    def read_into(self, key: ChunkKey, fingerprint_out: bytearray, buffer: memoryview) -> bool:
        """Copy the chunk's bytes into `buffer` and its layout fingerprint into
        `fingerprint_out`, both verified against the checksum written with them; False
        if the chunk is gone, damaged (it is then dropped), or not `len(buffer)` long."""

    @abstractmethod
    def write(self, key: ChunkKey, fingerprint: bytes, data: memoryview) -> None:
        """Keep a copy of the chunk; the tier may drop it later for room."""

    def write_chunk(self, key: ChunkKey, fingerprint: bytes, data: memoryview,
                    scope: ChunkScope, parent: bytes | None = None) -> None:
        """`write`, told whose chunk it is; a tier that keeps per-tenant quotas or tells a
        `TierListener` overrides it. Write-behind calls this one."""
        self.write(key, fingerprint, data)

    def status(self) -> dict[str, Any]:
        """What the admin API shows about the tier: at least its "name"; thread-safe."""
        return {"name": type(self).__name__}
