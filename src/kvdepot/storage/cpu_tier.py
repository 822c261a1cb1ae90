"""The first tier: chunks in one CPU memory pool, with read locks and LRU eviction per tenant.

Thread-safe: the control loop (lookups, locks) and the transfer threads (reserve, commit,
pin) call in concurrently. Every method holds `self._mutex` only for bookkeeping, never
during a copy.

Each tenant's chunks form an LRU list of their own (`TenantLimits` says what the tenant
may hold). A store past its tenant's quota evicts that tenant's own least recently used
chunks; a store that needs room beyond that takes the least recently used chunk among
its own and those of the tenants above their reserve, so one tenant's burst never takes
another below its guaranteed share. A tenant above its quota (lowered at run time) is
evicted from first. Choosing a victim looks at the head of each tenant's list: a handful
of tenants, not the chunks.

Tails (`keys.tail_key`) live in LRU lists of their own and are evicted before any whole
chunk: a tail saves less than a chunk's compute, so it never crowds one out. A tail made
redundant by a whole chunk or a longer tail (`demote`) goes first of all. The tier keeps
which tail lengths it holds after each chunk, so a lookup hashes only tails that exist.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Iterable

import torch

from kvdepot.errors import ChunkMissing
from kvdepot.keys import HASH_BYTES, ChunkKey, tail_tokens
from kvdepot.metrics import Counter
from kvdepot.storage.chunk import UNSCOPED, Chunk, ChunkScope, ChunkState
from kvdepot.storage.extent_allocator import ExtentAllocator
from kvdepot.storage.tenant_limits import TenantLimits
from kvdepot.storage.tier import TierListener

TIER_NAME = "cpu"
"""How KV events name this tier."""
_EVICTIONS_PER_ROUND = 256
"""Chunks `enforce_quota` evicts per hold of the mutex."""


class ReserveOutcome(enum.Enum):
    RESERVED = 1
    PRESENT = 2
    """The key is already held or being written by someone else: nothing to do."""
    FULL = 3
    """No room even after evicting every chunk this tenant may evict: the store must be
    skipped."""
    OVER_QUOTA = 4
    """The tenant's quota is full of its own locked or in-flight chunks."""


class CPUTier:
    def __init__(self, pool: torch.Tensor, alignment: int = 4096,
                 evictions: Counter | None = None, limits: TenantLimits | None = None,
                 listener: TierListener | None = None) -> None:
        self.pool = pool
        self._allocator = ExtentAllocator(pool.numel(), alignment)
        self._mutex = threading.Lock()
        self._ready: dict[ChunkKey, Chunk] = {}
        self._lru: dict[str, OrderedDict[ChunkKey, Chunk]] = {}  # per tenant, oldest first
        self._tail_lru: dict[str, OrderedDict[ChunkKey, Chunk]] = {}  # the same, of tails
        self._tail_lengths: dict[bytes, Tally[int]] = {}
        """Per parent chain hash, the lengths of the ready tails after it (all ranks)."""
        self.tail_bytes = 0
        """Bytes of the ready tails."""
        self._usage: dict[str, int] = {}  # bytes per tenant, chunks being written included
        self._by_scope: dict[ChunkScope, list[int]] = {}  # [chunks, bytes] of ready chunks
        self._clock = itertools.count(1)
        self._writing: dict[ChunkKey, Chunk] = {}
        self.evictions = evictions or Counter()
        self.limits = limits or TenantLimits()
        self.listener = listener

    # ---- capacity -------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._allocator.capacity

    @property
    def used_bytes(self) -> int:
        return self._allocator.allocated_bytes

    def __len__(self) -> int:
        return len(self._ready)

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tenant holding or writing chunks: "cpu_bytes" (in-flight stores included),
        "chunks" (readable ones)."""
        with self._mutex:
            return {tenant: {"cpu_bytes": nbytes,
                             "chunks": (len(self._lru.get(tenant, ()))
                                        + len(self._tail_lru.get(tenant, ())))}
                    for tenant, nbytes in self._usage.items()
                    if nbytes or self._lru.get(tenant) or self._tail_lru.get(tenant)}

    def usage_by_scope(self) -> dict[ChunkScope, tuple[int, int]]:
        """(chunks, bytes) of the readable chunks per (tenant, model, salt)."""
        with self._mutex:
            return {scope: (c, b) for scope, (c, b) in self._by_scope.items()}

    # ---- presence and locks -----------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return key in self._ready

    def _touch(self, chunk: Chunk) -> None:
        chunk.lru.move_to_end(chunk.key)
        chunk.last_use = next(self._clock)

    def lock_prefix(self, chunks: Iterable[list[ChunkKey]], count: int
                    ) -> tuple[list[list[ChunkKey]], list[ChunkKey] | None]:
        """Add `count` read locks to every key of the leading chunks whose keys are all
        present; returns those chunks and the first one that is not (None if all are).

        `chunks` may be lazy (hashing as it goes): it is consumed only up to that first
        miss. Presence and locks are settled in one pass under the mutex, so no chunk can
        be evicted between being found and being locked."""
        hit = []
        with self._mutex:
            ready, clock = self._ready, self._clock
            for keys in chunks:
                for key in keys:
                    if key not in ready:
                        return hit, keys
                for key in keys:  # `_touch`, inline: this loop is on a lookup's critical path
                    chunk = ready[key]
                    chunk.lock_count += count
                    chunk.lru.move_to_end(key)
                    chunk.last_use = next(clock)
                hit.append(keys)
        return hit, None

    def tail_lengths(self, parent: bytes) -> list[int]:
        """The lengths, longest first, of the tails held after the chunk whose chain hash
        is `parent` (the scope root for tails at a prompt's start)."""
        with self._mutex:
            lengths = self._tail_lengths.get(parent)
            return sorted(lengths, reverse=True) if lengths else []

    def demote(self, keys: Iterable[ChunkKey]) -> None:
        """Make the tails of `keys` that are held the first to be evicted (a whole chunk
        or a longer tail now holds their tokens too)."""
        with self._mutex:
            for key in keys:
                chunk = self._ready.get(key)
                if chunk is not None and tail_tokens(key):
                    chunk.lru.move_to_end(key, last=False)
                    chunk.last_use = 0

    def lock_if_present(self, key: ChunkKey, count: int) -> bool:
        with self._mutex:
            chunk = self._ready.get(key)
            if chunk is None:
                return False
            chunk.lock_count += count
            self._touch(chunk)
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
    def reserve(self, key: ChunkKey, nbytes: int, fingerprint: bytes,
                scope: ChunkScope = UNSCOPED, parent: bytes | None = None
                ) -> tuple[ReserveOutcome, Chunk | None]:
        """Claim room for a new chunk of `scope.tenant`, evicting as the module says.

        The chunk stays invisible until `commit`; `abort` gives the room back.
        """
        victims: list[Chunk] = []
        with self._mutex:
            try:
                if key in self._ready or key in self._writing:
                    return ReserveOutcome.PRESENT, None
                tenant = scope.tenant
                quota = self.limits.quota(tenant)
                if quota is not None:
                    while self._usage.get(tenant, 0) + nbytes > quota:
                        if not self._evict_own(tenant, victims):
                            return ReserveOutcome.OVER_QUOTA, None
                offset = self._allocator.allocate(nbytes)
                while offset is None:
                    if not self._evict_for(tenant, victims):
                        return ReserveOutcome.FULL, None
                    offset = self._allocator.allocate(nbytes)
                self._usage[tenant] = self._usage.get(tenant, 0) + nbytes
                # The parent serves the listener (KV events) and the index of tails:
                # otherwise no chunk keeps a bytes object it would never use.
                keep_parent = self.listener is not None or tail_tokens(key)
                chunk = Chunk(key=key, offset=offset, nbytes=nbytes, fingerprint=fingerprint,
                              scope=scope, parent=parent if keep_parent else None)
                self._writing[key] = chunk
                return ReserveOutcome.RESERVED, chunk
            finally:
                self._report(victims)

    def commit(self, chunk: Chunk, locks: int = 0) -> None:
        """Make the chunk visible, already holding `locks` read locks (so it cannot be
        evicted between becoming visible and being locked)."""
        with self._mutex:
            del self._writing[chunk.key]
            chunk.state = ChunkState.READY
            chunk.lock_count += locks
            chunk.last_use = next(self._clock)
            self._ready[chunk.key] = chunk
            length = tail_tokens(chunk.key)
            lists = self._tail_lru if length else self._lru
            chunk.lru = lists.setdefault(chunk.scope.tenant, OrderedDict())
            chunk.lru[chunk.key] = chunk
            if length:
                self.tail_bytes += chunk.nbytes
                parent = (chunk.parent or b"")[:HASH_BYTES]
                self._tail_lengths.setdefault(parent, Tally())[length] += 1
            counts = self._by_scope.setdefault(chunk.scope, [0, 0])
            counts[0] += 1
            counts[1] += chunk.nbytes
            if self.listener is not None:
                self.listener.stored(TIER_NAME, chunk.key, chunk.scope, chunk.parent)

    def abort(self, chunk: Chunk) -> None:
        with self._mutex:
            del self._writing[chunk.key]
            self._allocator.free(chunk.offset, chunk.nbytes)
            self._usage[chunk.scope.tenant] -= chunk.nbytes

    def enforce_quota(self, tenant: str) -> int:
        """Evict the tenant's least recently used chunks until it holds no more than its
        quota (after the quota was lowered); returns how many went."""
        evicted = 0
        while True:  # in rounds, so lookups get the mutex in between
            victims: list[Chunk] = []
            with self._mutex:
                quota = self.limits.quota(tenant)
                while (len(victims) < _EVICTIONS_PER_ROUND and quota is not None
                       and self._usage.get(tenant, 0) > quota
                       and self._evict_own(tenant, victims)):
                    pass
                self._report(victims)
            evicted += len(victims)
            if len(victims) < _EVICTIONS_PER_ROUND:
                return evicted

    # ---- eviction (under the mutex) -----------------------------------------------------
    def _first_evictable(self, tenant: str) -> Chunk | None:
        """The tenant's least recently used evictable tail, else whole chunk."""
        for lists in (self._tail_lru, self._lru):
            for chunk in lists.get(tenant, {}).values():
                if chunk.evictable:
                    return chunk
        return None

    def _evict_own(self, tenant: str, victims: list[Chunk]) -> bool:
        chunk = self._first_evictable(tenant)
        if chunk is None:
            return False
        self._drop(chunk, victims)
        self.evictions.add()
        return True

    def _evict_for(self, tenant: str, victims: list[Chunk]) -> bool:
        """Evict one chunk to make room for `tenant`: from a tenant above its quota first,
        else the least recently used among `tenant`'s own and those of tenants that stay
        at or above their reserve without it."""
        limits = self.limits
        best: Chunk | None = None
        best_rank = (True, True, 0)
        for other in set(self._lru) | set(self._tail_lru):
            chunk = self._first_evictable(other)
            if chunk is None:
                continue
            held = self._usage.get(other, 0)
            quota = limits.quota(other)
            over_quota = quota is not None and held > quota
            if (other != tenant and not over_quota
                    and held - chunk.nbytes < limits.reserve(other)):
                continue  # the other tenant's guaranteed share
            # Tails before whole chunks (of any tenant the rules let go).
            rank = (not over_quota, not tail_tokens(chunk.key), chunk.last_use)
            if best is None or rank < best_rank:
                best, best_rank = chunk, rank
        if best is None:
            return False
        self._drop(best, victims)
        self.evictions.add()
        return True

    def _drop(self, chunk: Chunk, victims: list[Chunk]) -> None:
        key, scope = chunk.key, chunk.scope
        del self._ready[key]
        del chunk.lru[key]
        length = tail_tokens(key)
        if length:
            self.tail_bytes -= chunk.nbytes
            parent = (chunk.parent or b"")[:HASH_BYTES]
            lengths = self._tail_lengths[parent]
            lengths[length] -= 1
            if not lengths[length]:
                del lengths[length]
                if not lengths:
                    del self._tail_lengths[parent]
        self._usage[scope.tenant] -= chunk.nbytes
        counts = self._by_scope[scope]
        counts[0] -= 1
        counts[1] -= chunk.nbytes
        if not counts[0]:
            del self._by_scope[scope]
        self._allocator.free(chunk.offset, chunk.nbytes)
        victims.append(chunk)

    def _report(self, victims: list[Chunk]) -> None:
        if victims and self.listener is not None:
            self.listener.removed(TIER_NAME, [(c.key, c.scope.tenant) for c in victims])

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
                self._touch(chunk)
            return chunks

    def unpin(self, chunks: Iterable[Chunk]) -> None:
        with self._mutex:
            for chunk in chunks:
                chunk.pin_count -= 1

    # ---- maintenance ------------------------------------------------------------------
    def clear(self, tenant: str | None = None, model: str | None = None,
              salt: str | None = None) -> int:
        """Drop every chunk (of `tenant`, `model`, `salt`, those given) nobody holds a lock
        or pin on; returns how many were dropped."""
        victims: list[Chunk] = []
        with self._mutex:
            tenants = set(self._lru) | set(self._tail_lru) if tenant is None else [tenant]
            for name, lists in itertools.product(tenants, (self._lru, self._tail_lru)):
                for chunk in [c for c in lists.get(name, {}).values() if c.evictable
                              and (model is None or c.scope.model == model)
                              and (salt is None or c.scope.salt == salt)]:
                    self._drop(chunk, victims)
            self._report(victims)
        return len(victims)

    def locked_chunks(self) -> int:
        with self._mutex:
            return sum(1 for c in self._ready.values() if c.lock_count)
