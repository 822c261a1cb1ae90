"""The interface of the tiers below CPU memory (local disk, Redis/Valkey).

The CPU memory tier (`CPUTier`) is where every copy to or from an engine happens;
a lower tier only ever exchanges whole chunks with it. Lookups that reach a lower
tier are answered asynchronously: the server brings the chunks up into CPU memory
in the background, and QUERY_PREFETCH_STATUS reports None until they are there.
Every method may do I/O and is never called on the control thread.

The batched methods (`stored_sizes`, `read_many`, `write_many`) have per-chunk
defaults; a tier behind a network overrides them so that one lookup or one batch of
writes costs one round trip, not one per chunk.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from kvdepot.keys import ChunkKey
from kvdepot.storage.chunk import ChunkScope

ChunkWrite = tuple[ChunkKey, bytes, memoryview, ChunkScope, "bytes | None"]
"""A chunk to write behind: key, layout fingerprint, bytes, whose it is, parent hash."""


class Probe(NamedTuple):
    nbytes: int
    round_trip_s: float
    write_s: float
    read_s: float


class TierListener(Protocol):
    """Told of every chunk that enters or leaves a tier (the KV events), under the tier's
    own mutex so that what it hears is in the tier's order: it must never block."""

    def stored(self, tier: str, key: ChunkKey, scope: ChunkScope, parent: bytes | None
               ) -> None: ...

    def removed(self, tier: str, chunks: list[tuple[ChunkKey, str]]) -> None:
        """(key, tenant) of each chunk that left `tier`."""


class LowerTier(ABC):
    name: str = "lower"
    """How logs, metrics and the admin API call the tier."""

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
        `TierListener` overrides it."""
        self.write(key, fingerprint, data)

    # ---- batched forms ------------------------------------------------------------------
    def stored_sizes(self, keys: list[ChunkKey]) -> list[int | None]:
        """`stored_size` of every key, in order (a tier may answer None for every key
        after the first it lacks: callers only use the leading run)."""
        sizes: list[int | None] = []
        for key in keys:
            size = self.stored_size(key)
            sizes.append(size)
            if size is None:
                break
        return sizes + [None] * (len(keys) - len(sizes))

    def holds_without_io(self, key: ChunkKey) -> bool | None:
        """Whether the tier holds `key`, if it can tell from memory alone (an index it
        keeps); None when only a read or a round trip could tell."""
        return None

    def stored_sizes_of_each(self, keys: list[ChunkKey]) -> list[int | None]:
        """`stored_size` of every key, each answered (for alternatives, such as a
        prompt's possible tails, rather than a run)."""
        return [self.stored_size(key) for key in keys]

    def read_many(self, reads: list[tuple[ChunkKey, memoryview]]) -> list[bytes | None]:
        """`read_into` of every (key, buffer): per read its layout fingerprint, or None
        if it failed."""
        out: list[bytes | None] = []
        for key, buffer in reads:
            fingerprint = bytearray()
            out.append(bytes(fingerprint) if self.read_into(key, fingerprint, buffer) else None)
        return out

    def write_many(self, writes: list[ChunkWrite]) -> int:
        """`write_chunk` of every chunk (write-behind calls this one); returns how many
        were written (a tier may skip chunks it already holds, or all of them while
        unreachable)."""
        for key, fingerprint, data, scope, parent in writes:
            self.write_chunk(key, fingerprint, data, scope, parent)
        return len(writes)

    def attach_write_queue(self, depth: Callable[[], int]) -> None:
        """The write-behind queue feeding this tier says how deep it is through `depth`."""
        self._queue_depth = depth

    def queued_writes(self) -> int:
        depth = getattr(self, "_queue_depth", None)
        return depth() if depth is not None else 0

    def count_dropped(self, chunks: int) -> None:
        """Chunks meant for this tier were dropped before reaching it (queue full)."""
        return None

    @property
    def available(self) -> bool:
        """False while the tier cannot be reached: callers skip it without waiting."""
        return True

    def status(self) -> dict[str, Any]:
        """What the admin API shows about the tier: at least its "name"; thread-safe."""
        return {"name": self.name}

    def probe(self) -> Probe | None:
        """Write a small value and read it back, timed, so that the first lookup already
        knows how fast the tier is (`load_speed`); None if the tier does not need it
        (local, fast) or cannot be reached."""
        return None

    def close(self) -> None:
        """Stop background work and release connections."""
        return None
