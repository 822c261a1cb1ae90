"""STORE and RETRIEVE: validation, chunk keys, and the copies between engine and cache.

Everything an operation could get wrong is checked before the first byte moves: the
engine is registered, the range is chunk-aligned (a retrieve's end may fall inside its last
chunk, whose blocks before the end are then the only ones written) and inside the tokens,
the block list
covers it, every block id lies inside the registered cache, and (for a retrieve) every
chunk is present and was stored in the reader's layout.

The copies themselves run inside the operation's fence (`kvdepot.transfer.fence`): only
while the worker still waits for the operation, and the worker cannot give up on it while
they run. A store commits its chunks only after the fence says DONE.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from kvdepot.errors import ChunkMissing, InvalidRequest, LayoutMismatch, OperationCancelled
from kvdepot.keys import HASH_BYTES, ChunkKey, chain_hashes, rank_key, scope_root
from kvdepot.metrics import MetricsRegistry
from kvdepot.protocol import (
    BlockTransfer,
    KeyScope,
    Retrieve,
    RetrieveResult,
    Store,
    StoreResult,
    unpack_ints,
)
from kvdepot.rpc.auth import Caller
from kvdepot.server.block_events import BlockEventLog, hash_width
from kvdepot.server.engines import EngineRegistry, RegisteredEngine
from kvdepot.server.lookups import LookupTable, session_key
from kvdepot.storage.chunk import Chunk, ChunkScope
from kvdepot.storage.cpu_tier import CPUTier, ReserveOutcome
from kvdepot.transfer.group_copy import GroupCopy, PoolExtents
from kvdepot.transfer.layout import CopyPlan

log = logging.getLogger(__name__)


class DataPath:
    def __init__(self, tier: CPUTier, engines: EngineRegistry, lookups: LookupTable,
                 chunk_size: int, metrics: MetricsRegistry,
                 on_commit: Callable[[list[ChunkKey]], None] | None = None,
                 block_events: BlockEventLog | None = None) -> None:
        self._on_commit = on_commit
        self._block_events = block_events
        self.tier = tier
        self.engines = engines
        self.lookups = lookups
        self.chunk_size = chunk_size
        self.metrics = metrics
        self._pool = tier.pool.numpy()

    def _group_copies(self, engine: RegisteredEngine, plans: list[CopyPlan],
                      chunks: list[Chunk]) -> list[GroupCopy]:
        """Each KV cache group's plan with its part of each chunk, as extents of the pool
        (one copier call, and one message to a copy process, for the whole operation)."""
        starts = np.array([c.offset for c in chunks], dtype=np.int64)
        within = engine.layout.group_offsets(engine.blocks_per_chunk)
        return [GroupCopy(plan, PoolExtents(self._pool, starts + at,
                                            engine.blocks_per_chunk * group.block_bytes))
                for plan, group, at in zip(plans, engine.layout.groups, within, strict=True)]

    def _keys_and_blocks(self, engine: RegisteredEngine, request: BlockTransfer,
                         partial_last_chunk: bool = False
                         ) -> tuple[list[ChunkKey], list[tuple[np.ndarray, int]], bytes | None]:
        """The chunk keys of [start, end); per KV cache group, the block ids holding its
        tokens and how many of them lead as unheld (see `EngineLayout.group_blocks`), all
        validated; and the chain hash before the first key (None at a prompt's start). A
        retrieve (`partial_last_chunk`) may end inside a chunk: that chunk is read whole
        from the cache, and only the blocks holding tokens before `end` are named and
        written; it may also name unheld blocks."""
        cs = self.chunk_size
        bs = engine.layout.block_size
        start, end = request.start, request.end
        tokens = unpack_ints(request.token_ids)
        if start % cs or not 0 <= start <= end or (end % cs and not partial_last_chunk):
            raise InvalidRequest(f"range [{start}, {end}) is not aligned to the chunk size {cs}")
        chunk_end = -(-end // cs) * cs
        if chunk_end > len(tokens):
            what = "the chunk holding its end goes" if chunk_end > end else "it goes"
            raise InvalidRequest(f"range [{start}, {end}): {what} past the {len(tokens)} "
                                 "tokens sent")
        needed = -(-end // bs) - start // bs
        lists = [unpack_ints(request.block_ids),
                 *(unpack_ints(ids) for ids in request.group_block_ids)]
        try:
            groups = engine.layout.group_blocks(lists, needed, unheld_allowed=partial_last_chunk)
        except InvalidRequest as exc:
            raise InvalidRequest(f"range [{start}, {end}): {exc}") from None
        # scope_root validates the salt; the tenant is the registration's credential's.
        root = scope_root(KeyScope(engine.model, engine.world_size, request.cache_salt),
                          engine.tenant)
        hashes = chain_hashes(root, tokens, cs, chunk_end // cs)
        keys = [rank_key(h, engine.rank) for h in hashes[start // cs:]]
        return keys, groups, hashes[start // cs - 1] if start else None

    # ---- STORE ----------------------------------------------------------------------------
    def store(self, request: Store, caller: Caller) -> StoreResult:
        try:
            return self._store(request, caller)
        except Exception:
            self.metrics.add(store_errors=1)
            raise

    def _store(self, request: Store, caller: Caller) -> StoreResult:
        engine = self.engines.get(request.instance_id, caller.connection)
        engine.fence.check_slot(request.fence_slot)
        keys, groups, parent = self._keys_and_blocks(engine, request)
        if request.block_hashes and self._block_events is not None:
            width = hash_width(request.block_hashes, request.hash_block_size,
                               request.end - request.start, self.chunk_size)
            previous = rank_key(parent, engine.rank) if parent is not None else None
            self._block_events.learn(keys, engine.tenant, bytes(request.block_hashes), width,
                                     request.hash_block_size, previous)
        layout = engine.layout
        nbytes = engine.chunk_bytes
        per_chunk = engine.blocks_per_chunk
        scope = ChunkScope(engine.tenant, engine.model, request.cache_salt)
        reserved: list[Chunk] = []
        slots: list[int] = []
        present = full = over_quota = 0
        try:
            for i, key in enumerate(keys):
                outcome, chunk = self.tier.reserve(key, nbytes, layout.fingerprint, scope,
                                                   parent)
                parent = key[:HASH_BYTES]
                if outcome is ReserveOutcome.RESERVED:
                    reserved.append(chunk)  # type: ignore[arg-type]
                    slots.append(i)
                elif outcome is ReserveOutcome.PRESENT:
                    present += 1
                elif outcome is ReserveOutcome.OVER_QUOTA:
                    over_quota += 1
                else:
                    full += 1
            plans = []
            if reserved:
                for group, (block_ids, _) in zip(layout.groups, groups, strict=True):
                    ids = np.concatenate([block_ids[i * per_chunk:(i + 1) * per_chunk]
                                          for i in slots])
                    plans.append(group.plan(ids, per_chunk))
            with engine.fence.hold(request.fence_slot, request.fence_generation):
                if plans:
                    engine.copier.gather(self._group_copies(engine, plans, reserved),
                                         request.event_handle)
        except BaseException as exc:
            for chunk in reserved:
                self.tier.abort(chunk)
            if isinstance(exc, OperationCancelled):
                self.metrics.add(cancelled_operations=1)
            raise
        for chunk in reserved:
            self.tier.commit(chunk)
        if reserved and self._on_commit is not None:
            self._on_commit([chunk.key for chunk in reserved])
        if full:
            log.warning("store for %s: %d of %d chunks skipped, CPU memory is full of locked or "
                        "in-flight chunks", request.request_id, full, len(keys))
        self.metrics.add(stores=1, stored_chunks=len(reserved), store_present_chunks=present,
                          store_skipped_full_chunks=full, store_skipped_quota_chunks=over_quota,
                          stored_bytes=len(reserved) * nbytes)
        return StoreResult(stored=len(reserved), present=present,
                           skipped_full=full + over_quota)

    # ---- RETRIEVE ---------------------------------------------------------------------------
    def retrieve(self, request: Retrieve, caller: Caller) -> RetrieveResult:
        try:
            return self._retrieve(request, caller)
        except Exception:
            self.metrics.add(retrieve_errors=1)
            raise

    def _retrieve(self, request: Retrieve, caller: Caller) -> RetrieveResult:
        engine = self.engines.get(request.instance_id, caller.connection)
        engine.fence.check_slot(request.fence_slot)
        keys, groups, _ = self._keys_and_blocks(engine, request, partial_last_chunk=True)
        layout = engine.layout
        skip = request.skip_first_n_tokens
        if skip < 0 or skip > request.end - request.start or skip % layout.block_size:
            raise InvalidRequest(f"skip_first_n_tokens={skip} must be a multiple of the block "
                                 f"size {layout.block_size} within the range "
                                 f"[{request.start}, {request.end})")
        try:
            pinned = self.tier.pin(keys)
        except ChunkMissing as exc:
            chunk = request.start // self.chunk_size + exc.index
            raise ChunkMissing(f"chunk {chunk} (tokens from {chunk * self.chunk_size}) of "
                               f"request {request.request_id} is not in the cache") from None
        try:
            nbytes = engine.chunk_bytes
            for chunk in pinned:
                if chunk.fingerprint != layout.fingerprint or chunk.nbytes != nbytes:
                    raise LayoutMismatch("a requested chunk was stored by an engine with a "
                                         "different KV cache layout; it cannot be loaded here")
            # Per group, blocks shared with the engine's prefix cache and blocks it does
            # not hold (before a sliding window) are left out.
            plans = [group.plan(block_ids, engine.blocks_per_chunk,
                                first_slot=max(skip // layout.block_size, unheld))
                     for group, (block_ids, unheld) in zip(layout.groups, groups, strict=True)]
            with engine.fence.hold(request.fence_slot, request.fence_generation):
                engine.copier.scatter(self._group_copies(engine, plans, pinned),
                                      request.event_handle)
        except OperationCancelled:
            self.metrics.add(cancelled_operations=1)
            raise
        finally:
            self.tier.unpin(pinned)
        self.lookups.release_reads(session_key(engine.tenant, request.request_id), keys)
        self.metrics.add(retrieves=1, retrieved_chunks=len(keys),
                          retrieved_bytes=len(keys) * nbytes)
        return RetrieveResult(retrieved=len(keys))
