"""The interface of the tiers below CPU memory (local disk, Redis/Valkey).

The CPU memory tier (`MemoryTier`) is where every copy to or from an engine happens;
a lower tier only ever exchanges whole chunks with it. Lookups that reach a lower
tier are answered asynchronously: the server brings the chunks up into CPU memory
in the background, and QUERY_PREFETCH_STATUS reports None until they are there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvdepot.keys import ChunkKey


class LowerTier(ABC):
    name: str

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Whether the tier holds the chunk; may do I/O, never called on the control thread."""

    @abstractmethod
    def read_into(self, key: ChunkKey, fingerprint_out: bytearray, buffer: memoryview) -> bool:
        """Copy the chunk's bytes into `buffer` and its layout fingerprint into
        `fingerprint_out`; False if the chunk is gone or does not fit."""

    @abstractmethod
    def write(self, key: ChunkKey, fingerprint: bytes, data: memoryview) -> None:
        """Keep a copy of the chunk; may drop it later under the tier's own capacity."""

    def close(self) -> None:  # noqa: B027 - optional for tiers that hold nothing
        """Release files and connections."""
