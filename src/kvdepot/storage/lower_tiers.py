"""Moving chunks between CPU memory and the tiers below it.

Write-behind: every chunk committed to CPU memory is copied to each lower tier by a
background thread (pinned meanwhile, so eviction cannot pull it away mid-write).
Promotion: a lookup that runs past what CPU memory holds asks the lower tiers, chunk
by chunk, and reads what they have into CPU memory, committed with its read locks.
"""

from __future__ import annotations

import logging
import queue
import threading

from kvdepot.errors import ChunkMissing
from kvdepot.keys import ChunkKey
from kvdepot.metrics import Counter
from kvdepot.storage.chunk import UNSCOPED, ChunkScope
from kvdepot.storage.cpu_tier import CPUTier, ReserveOutcome
from kvdepot.storage.tier import LowerTier

log = logging.getLogger(__name__)

WRITE_QUEUE_CHUNKS = 4096
"""Beyond this backlog new chunks skip the lower tiers rather than grow memory use."""


class LowerTiers:
    def __init__(self, memory: CPUTier, tiers: list[LowerTier], *,
                 written: Counter | None = None, promoted: Counter | None = None,
                 dropped_writes: Counter | None = None) -> None:
        self.memory = memory
        self.tiers = tiers
        self._pool = memory.pool.numpy()
        self._writes: queue.Queue[ChunkKey | None] = queue.Queue(WRITE_QUEUE_CHUNKS)
        self.written = written or Counter()
        self.promoted = promoted or Counter()
        self.dropped_writes = dropped_writes or Counter()
        self._writer = threading.Thread(target=self._write_loop, name="kvdepot-write-behind",
                                        daemon=True)
        if tiers:
            self._writer.start()

    def __bool__(self) -> bool:
        return bool(self.tiers)

    # ---- write-behind -----------------------------------------------------------------
    def write_behind(self, keys: list[ChunkKey]) -> None:
        for key in keys:
            try:
                self._writes.put_nowait(key)
            except queue.Full:
                self.dropped_writes.add()

    def _write_loop(self) -> None:
        while (key := self._writes.get()) is not None:
            try:
                self._write_one(key)
            except Exception:
                log.exception("writing a chunk to the lower tiers failed")
            finally:
                self._writes.task_done()
        self._writes.task_done()

    def _write_one(self, key: ChunkKey) -> None:
        try:
            pinned = self.memory.pin([key])
        except ChunkMissing:
            return  # evicted before its turn came
        (chunk,) = pinned
        try:
            data = memoryview(self._pool[chunk.offset:chunk.offset + chunk.nbytes])
            for tier in self.tiers:
                tier.write_chunk(key, chunk.fingerprint, data, chunk.scope, chunk.parent)
            self.written.add()
        finally:
            self.memory.unpin(pinned)

    def close(self) -> None:
        """Write behind every chunk queued so far, then stop."""
        if self.tiers:
            self._writes.put(None)
            self._writer.join(timeout=30)

    # ---- promotion ---------------------------------------------------------------------
    def bring_up(self, key: ChunkKey, locks: int, scope: ChunkScope = UNSCOPED,
                 parent: bytes | None = None) -> bool:
        """Make `key` present in CPU memory holding `locks` read locks; False if no tier
        has it (or it could not be read or find room). It is stored as `scope`'s (the
        lookup's: keys are scoped, so it is the one that stored it) under its quota."""
        if self.memory.lock_if_present(key, locks):
            return True
        for tier in self.tiers:
            nbytes = tier.stored_size(key)
            if nbytes is None:
                continue
            outcome, chunk = self.memory.reserve(key, nbytes, b"", scope, parent)
            if outcome is ReserveOutcome.PRESENT:
                return self.memory.lock_if_present(key, locks)
            if chunk is None:
                return False  # CPU memory is full of locked chunks
            fingerprint = bytearray()
            view = memoryview(self._pool[chunk.offset:chunk.offset + nbytes])
            if not tier.read_into(key, fingerprint, view):
                self.memory.abort(chunk)
                continue
            chunk.fingerprint = bytes(fingerprint)
            self.memory.commit(chunk, locks)
            self.promoted.add()
            return True
        return False
