"""The first tier: chunks in one CPU memory pool, with read locks and LRU eviction.

Thread-safe: the control loop (lookups, locks) and the transfer threads (reserve, commit,
pin) call in concurrently. Every method holds `self._mutex` only for bookkeeping, never
during a copy.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Iterable

import torch

from kvdepot.errors import ChunkMissing
from kvdepot.keys import ChunkKey
from kvdepot.metrics import Counter
from kvdepot.storage.chunk import Chunk, ChunkState
from kvdepot.storage.extent_allocator import ExtentAllocator


class ReserveOutcome(enum.Enum):
    RESERVED = 1
    PRESENT = 2
    """The key is already held or being written by someone else: nothing to do."""
    FULL = 3
    """No room even after evicting every evictable chunk: the store must be skipped."""


class CPUTier:
    def __init__(self, pool: torch.Tensor, alignment: int = 4096,
                 evictions: Counter | None = None) -> None:
        self.pool = pool
        self._allocator = ExtentAllocator(pool.numel(), alignment)
        self._mutex = threading.Lock()
        self._ready: OrderedDict[ChunkKey, Chunk] = OrderedDict()  # LRU order, oldest first
        self._writing: dict[ChunkKey, Chunk] = {}
        self.evictions = evictions or Counter()

    # ---- capacity -------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._allocator.capacity

    @property
    def used_bytes(self) -> int:
        return self._allocator.allocated_bytes

    def __len__(self) -> int:
        return len(self._ready)

    # ---- presence and locks -----------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return key in self._ready

    def lock_prefix(self, chunks: Iterable[list[ChunkKey]], count: int
                    ) -> tuple[list[list[ChunkKey]], list[ChunkKey] | None]:
        """Add `count` read locks to every key of the leading chunks whose keys are all
        present; returns those chunks and the first one that is not (None if all are).

        `chunks` may be lazy (hashing as it goes): it is consumed only up to that first
        miss. Presence and locks are settled in one pass under the mutex, so no chunk can
        be evicted between being found and being locked."""
        hit = []
        with self._mutex:
            ready = self._ready
            for keys in chunks:
                for key in keys:
                    if key not in ready:
                        return hit, keys
                for key in keys:
                    ready[key].lock_count += count
                    ready.move_to_end(key)
                hit.append(keys)
        return hit, None

    def lock_if_present(self, key: ChunkKey, count: int) -> bool:
        with self._mutex:
            chunk = self._ready.get(key)
            if chunk is None:
                return False
            chunk.lock_count += count
            self._ready.move_to_end(key)
            return True

    def unlock(self, counts: dict[ChunkKey, int]) -> None:
        """Remove `counts[key]` read locks from each key's chunk."""
        with self._mutex:
            ready = self._ready
            for key, count in counts.items():
                chunk = ready.get(key)
                if chunk is not None:
                    left = chunk.lock_count - count
                    chunk.lock_count = left if left > 0 else 0

    def locked_bytes(self, keys: Iterable[ChunkKey]) -> int:
        """The bytes of the keys' chunks (which the caller holds locked, so all present)."""
        ready = self._ready
        return sum(chunk.nbytes for key in keys if (chunk := ready.get(key)) is not None)

    def lock_count(self, key: ChunkKey) -> int:
        chunk = self._ready.get(key)
        return 0 if chunk is None else chunk.lock_count

    # ---- writing ----------------------------------------------------------------------
    def reserve(self, key: ChunkKey, nbytes: int, fingerprint: bytes
                ) -> tuple[ReserveOutcome, Chunk | None]:
        """Claim room for a new chunk, evicting least recently used chunks if needed.

        The chunk stays invisible until `commit`; `abort` gives the room back.
        """
        with self._mutex:
            if key in self._ready or key in self._writing:
                return ReserveOutcome.PRESENT, None
            offset = self._allocator.allocate(nbytes)
            while offset is None:
                if not self._evict_one():
                    return ReserveOutcome.FULL, None
                offset = self._allocator.allocate(nbytes)
            chunk = Chunk(key=key, offset=offset, nbytes=nbytes, fingerprint=fingerprint)
            self._writing[key] = chunk
            return ReserveOutcome.RESERVED, chunk

    def commit(self, chunk: Chunk, locks: int = 0) -> None:
        """Make the chunk visible, already holding `locks` read locks (so it cannot be
        evicted between becoming visible and being locked)."""
        with self._mutex:
            del self._writing[chunk.key]
            chunk.state = ChunkState.READY
            chunk.lock_count += locks
            self._ready[chunk.key] = chunk

    def abort(self, chunk: Chunk) -> None:
        with self._mutex:
            del self._writing[chunk.key]
            self._allocator.free(chunk.offset, chunk.nbytes)

    def _evict_one(self) -> bool:
        for key, chunk in self._ready.items():
            if chunk.evictable:
                del self._ready[key]
                self._allocator.free(chunk.offset, chunk.nbytes)
                self.evictions.add()
                return True
        return False

    # ---- reading ----------------------------------------------------------------------
    def pin(self, keys: list[ChunkKey]) -> list[Chunk]:
        """Pin every key's chunk for reading; if one is missing, pin none and raise
        ChunkMissing with its index."""
        with self._mutex:
            chunks: list[Chunk] = []
            for i, key in enumerate(keys):
                chunk = self._ready.get(key)
                if chunk is None:
                    raise ChunkMissing(f"chunk {i} of the {len(keys)} asked for is not in the "
                                       "cache", index=i)
                chunks.append(chunk)
            for chunk in chunks:
                chunk.pin_count += 1
                self._ready.move_to_end(chunk.key)
            return chunks

    def unpin(self, chunks: Iterable[Chunk]) -> None:
        with self._mutex:
            for chunk in chunks:
                chunk.pin_count -= 1

    # ---- maintenance ------------------------------------------------------------------
    def clear(self) -> int:
        """Drop every chunk nobody holds a lock or pin on; returns how many were dropped."""
        with self._mutex:
            victims = [key for key, chunk in self._ready.items() if chunk.evictable]
            for key in victims:
                chunk = self._ready.pop(key)
                self._allocator.free(chunk.offset, chunk.nbytes)
            return len(victims)

    def locked_chunks(self) -> int:
        with self._mutex:
            return sum(1 for c in self._ready.values() if c.lock_count)
