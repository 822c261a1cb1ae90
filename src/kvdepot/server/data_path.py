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

import itertools
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kvdepot.errors import ChunkMissing, InvalidRequest, LayoutMismatch, OperationCancelled
from kvdepot.keys import (
    HASH_BYTES,
    ChunkKey,
    chain_hashes,
    rank_key,
    scope_root,
    state_key,
    tail_hash,
    tail_key,
    tail_keys,
    tail_tokens,
)
from kvdepot.metrics import MetricsRegistry
from kvdepot.protocol import (
    KeyScope,
    Retrieve,
    RetrieveResult,
    Store,
    StoreResult,
    unpack_ints,
)
from kvdepot.rpc.auth import Caller
from kvdepot.server.block_event_log import BlockEventLog, hash_width
from kvdepot.server.engines import EngineRegistry, RegisteredEngine
from kvdepot.server.lookups import LookupTable, session_key
from kvdepot.storage.chunk import Chunk, ChunkScope
from kvdepot.storage.cpu_tier import CPUTier, ReserveOutcome
from kvdepot.transfer.group_copy import GroupCopy, PoolExtents
from kvdepot.transfer.layout import CopyPlan

log = logging.getLogger(__name__)


class _Pieces(NamedTuple):
    """What a store or retrieve copies: `keys` of its whole chunks (the first `whole`)
    and of its tail (`tail` tokens; none when 0), and per KV cache group the block ids
    holding its tokens with how many of them lead as unheld (`EngineLayout.group_blocks`)."""

    keys: list[ChunkKey]
    whole: int
    tail: int
    groups: list[tuple[np.ndarray, int]]
    parent: bytes | None
    """The chain hash before the first key (None at a prompt's start)."""
    root: bytes
    tokens: np.ndarray
    state: ChunkKey | None = None
    """The key of the recurrent state after the range (`with_state`), else None."""
    state_blocks: list[np.ndarray] = []
    """Each state group's one block holding that state."""

    def before(self, index: int) -> bytes:
        """The chain hash the piece `index` follows (the scope root at a prompt's start)."""
        if index:
            return self.keys[index - 1][:HASH_BYTES]
        return self.parent if self.parent is not None else self.root


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
                      chunks: list[Chunk], blocks: int) -> list[GroupCopy]:
        """Each KV cache group's plan with its part of each chunk, as extents of the pool
        (one copier call, and one message to a copy process, for the whole operation);
        the chunks hold `blocks` blocks each (a tail fewer than a whole chunk)."""
        starts = np.array([c.offset for c in chunks], dtype=np.int64)
        within = engine.layout.group_offsets(blocks)
        return [GroupCopy(plan, PoolExtents(self._pool, starts + at, blocks * group.block_bytes))
                for plan, group, at in zip(plans, engine.layout.token_groups, within,
                                           strict=True)]

    def _state_copies(self, engine: RegisteredEngine, pieces: _Pieces, piece: Chunk
                      ) -> list[GroupCopy]:
        """Each state group's one block to or from its part of the state piece `piece`
        (the groups' blocks one after another)."""
        copies, at = [], piece.offset
        for group, block in zip(engine.layout.state_groups, pieces.state_blocks, strict=True):
            copies.append(GroupCopy(group.plan(block, 1), PoolExtents(
                self._pool, np.array([at], dtype=np.int64), group.block_bytes)))
            at += group.block_bytes
        return copies

    def _pieces(self, engine: RegisteredEngine, request: Store | Retrieve,
                partial_last: bool = False) -> _Pieces:
        """The keys of [start, end), validated with the blocks holding it (see `_Pieces`).
        A retrieve (`partial_last`) may end inside its last chunk or tail: that one is
        read whole from the cache, and only the blocks holding tokens before `end` are
        named and written; it may also name unheld blocks."""
        cs = self.chunk_size
        bs = engine.layout.block_size
        start, end, tail = request.start, request.end, request.tail_tokens
        tokens = unpack_ints(request.token_ids)
        if start % cs or not 0 <= start <= end:
            raise InvalidRequest(f"range [{start}, {end}) is not aligned to the chunk size {cs}")
        if request.with_state and (tail or end % cs or end <= start):
            # The state after a partial chunk or a tail is no block boundary's of ours.
            raise InvalidRequest(f"range [{start}, {end}): a recurrent state is carried only "
                                 f"by a range of whole chunks of {cs} tokens, after its end")
        if tail:
            if tail >= cs:
                raise InvalidRequest(f"a tail of {tail} tokens: a tail holds fewer tokens than "
                                     f"a chunk ({cs})")
            if len(engine.layout.groups) > 1:
                raise InvalidRequest("tails are kept only for engines with one KV cache group "
                                     "(a sliding window's blocks would not line up with them)")
            tail_start = max(end - 1, start) // cs * cs
            if end == start or end > tail_start + tail or (end < tail_start + tail
                                                           and not partial_last):
                raise InvalidRequest(f"range [{start}, {end}) does not end in its tail of "
                                     f"{tail} tokens")
            key_end = tail_start + tail
        else:
            if end % cs and not partial_last:
                raise InvalidRequest(f"range [{start}, {end}) is not aligned to the chunk size "
                                     f"{cs}")
            tail_start = key_end = -(-end // cs) * cs
        if key_end > len(tokens):
            what = "the chunk holding its end goes" if key_end > end else "it goes"
            raise InvalidRequest(f"range [{start}, {end}): {what} past the {len(tokens)} "
                                 "tokens sent")
        needed = -(-end // bs) - start // bs
        lists = [unpack_ints(request.block_ids),
                 *(unpack_ints(ids) for ids in request.group_block_ids)]
        try:
            groups = engine.layout.group_blocks(lists, needed, unheld_allowed=partial_last)
            state_blocks = engine.layout.state_blocks(lists, request.with_state)
        except InvalidRequest as exc:
            raise InvalidRequest(f"range [{start}, {end}): {exc}") from None
        # scope_root validates the salt; the tenant is the registration's credential's.
        root = scope_root(KeyScope(engine.model, engine.world_size, request.cache_salt),
                          engine.tenant)
        hashes = chain_hashes(root, tokens, cs, tail_start // cs)
        keys = [rank_key(h, engine.rank) for h in hashes[start // cs:]]
        whole = len(keys)
        if tail:
            before = hashes[-1] if hashes else root  # the chain hash the tail follows
            keys.append(tail_key(tail_hash(before, tokens[tail_start:key_end]), engine.rank,
                                 tail))
        state = state_key(hashes[-1], engine.rank) if request.with_state else None
        return _Pieces(keys, whole, tail, groups, hashes[start // cs - 1] if start else None,
                       root, tokens, state, state_blocks)

    def _supersede(self, engine: RegisteredEngine, pieces: _Pieces, start: int) -> None:
        """Demote the tails held after the parent of each piece stored whose tokens that
        piece holds too (a whole chunk, or a longer tail)."""
        cs = self.chunk_size
        for index, key in enumerate(pieces.keys):
            before = pieces.before(index)
            held = self.tier.tail_lengths(before)
            if not held:
                continue
            length = tail_tokens(key) or cs
            shorter = [n for n in held if n < length]
            if shorter:
                self.tier.demote(itertools.chain.from_iterable(tail_keys(
                    before, pieces.tokens, start + index * cs, shorter, [engine.rank])))

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
        pieces = self._pieces(engine, request)
        keys = pieces.keys
        if request.block_hashes and self._block_events is not None:
            # Whole chunks only: a tail is never reported (`TierListeners`).
            width = hash_width(request.block_hashes, request.hash_block_size,
                               pieces.whole * self.chunk_size, self.chunk_size)
            previous = (rank_key(pieces.parent, engine.rank) if pieces.parent is not None
                        else None)
            self._block_events.learn(keys[:pieces.whole], engine.tenant,
                                     bytes(request.block_hashes), width,
                                     request.hash_block_size, previous)
        layout = engine.layout
        per_chunk = engine.blocks_per_chunk
        tail_blocks = -(-pieces.tail // layout.block_size)
        scope = ChunkScope(engine.tenant, engine.model, request.cache_salt)
        reserved: list[Chunk] = []
        slots: list[int] = []
        present = full = over_quota = 0
        state_chunk: Chunk | None = None
        try:
            for i, key in enumerate(keys):
                is_tail = i >= pieces.whole
                nbytes = tail_blocks * layout.block_bytes if is_tail else engine.chunk_bytes
                # A whole chunk at a prompt's start has no parent (KV events say so); a
                # tail's parent is what the index of tails finds it by.
                parent = (pieces.before(i) if i or is_tail or pieces.parent is not None
                          else None)
                outcome, chunk = self.tier.reserve(key, nbytes, layout.fingerprint, scope,
                                                   parent)
                if outcome is ReserveOutcome.RESERVED:
                    reserved.append(chunk)  # type: ignore[arg-type]
                    slots.append(i)
                elif outcome is ReserveOutcome.PRESENT:
                    present += 1
                elif outcome is ReserveOutcome.OVER_QUOTA:
                    over_quota += 1
                else:
                    full += 1
            if pieces.state is not None:
                # Reserved with its chunks, copied under the same fence and committed with
                # them. A state held without a chunk before it is never found (a lookup
                # reaches a state only through its chunk); a chunk held without it ends
                # no hit, though a later store may still add it.
                outcome, state_chunk = self.tier.reserve(pieces.state, layout.state_bytes,
                                                         layout.fingerprint, scope, None)
                if outcome is ReserveOutcome.PRESENT:
                    present += 1
                elif outcome is ReserveOutcome.OVER_QUOTA:
                    over_quota += 1
                elif outcome is not ReserveOutcome.RESERVED:
                    full += 1
                if outcome is not ReserveOutcome.RESERVED:
                    state_chunk = None
            # Whole chunks in one copier call, a tail (fewer blocks per piece) in another.
            copies = []
            whole = [(i, c) for i, c in zip(slots, reserved, strict=True) if i < pieces.whole]
            if whole:
                copies.append(self._group_copies(engine, [
                    group.plan(np.concatenate([block_ids[i * per_chunk:(i + 1) * per_chunk]
                                               for i, _ in whole]), per_chunk)
                    for group, (block_ids, _) in zip(layout.token_groups, pieces.groups,
                                                     strict=True)
                ], [c for _, c in whole], per_chunk))
            if len(whole) < len(reserved):  # the tail
                block_ids = pieces.groups[0][0][pieces.whole * per_chunk:]
                copies.append(self._group_copies(engine, [layout.groups[0].plan(
                    block_ids, tail_blocks)], reserved[-1:], tail_blocks))
            if state_chunk is not None:
                copies.append(self._state_copies(engine, pieces, state_chunk))
            with engine.fence.hold(request.fence_slot, request.fence_generation):
                for groups in copies:
                    engine.copier.gather(groups, request.event_handle)
        except BaseException as exc:
            if state_chunk is not None:
                self.tier.abort(state_chunk)
            for chunk in reserved:
                self.tier.abort(chunk)
            if isinstance(exc, OperationCancelled):
                self.metrics.add(cancelled_operations=1)
            raise
        for chunk in reserved:
            self.tier.commit(chunk)
        if state_chunk is not None:
            self.tier.commit(state_chunk)
        if reserved:
            self._supersede(engine, pieces, request.start)
        committed = [*reserved, *([state_chunk] if state_chunk is not None else [])]
        if committed and self._on_commit is not None:
            self._on_commit([chunk.key for chunk in committed])
        if full:
            log.warning("store for %s: %d of %d chunks skipped, CPU memory is full of locked or "
                        "in-flight chunks", request.request_id, full, len(keys))
        tails = sum(1 for chunk in reserved if tail_tokens(chunk.key))
        self.metrics.add(stores=1, stored_chunks=len(reserved) - tails, stored_tails=tails,
                         stored_states=int(state_chunk is not None),
                         store_present_chunks=present, store_skipped_full_chunks=full,
                         store_skipped_quota_chunks=over_quota,
                         stored_bytes=sum(chunk.nbytes for chunk in committed))
        return StoreResult(stored=len(committed), present=present,
                           skipped_full=full + over_quota)

    # ---- RETRIEVE ---------------------------------------------------------------------------
    def retrieve(self, request: Retrieve, caller: Caller) -> RetrieveResult:
        try:
            return self._retrieve(request, caller)
        except Exception:
            self.metrics.add(retrieve_errors=1)
            raise

    def _retrieve(self, request: Retrieve, caller: Caller) -> RetrieveResult:
        started = time.perf_counter()
        engine = self.engines.get(request.instance_id, caller.connection)
        engine.fence.check_slot(request.fence_slot)
        pieces = self._pieces(engine, request, partial_last=True)
        keys = pieces.keys
        layout = engine.layout
        skip = request.skip_first_n_tokens
        if skip < 0 or skip > request.end - request.start or skip % layout.block_size:
            raise InvalidRequest(f"skip_first_n_tokens={skip} must be a multiple of the block "
                                 f"size {layout.block_size} within the range "
                                 f"[{request.start}, {request.end})")
        read = [*keys, *([pieces.state] if pieces.state is not None else [])]
        try:
            pinned = self.tier.pin(read)
        except ChunkMissing as exc:
            chunk = request.start // self.chunk_size + exc.index
            if exc.index >= len(keys):
                raise ChunkMissing(f"the recurrent state after token {request.end} of request "
                                   f"{request.request_id} is not in the cache") from None
            what = "tail" if exc.index >= pieces.whole else "chunk"
            raise ChunkMissing(f"{what} {chunk} (tokens from {chunk * self.chunk_size}) of "
                               f"request {request.request_id} is not in the cache") from None
        try:
            per_chunk = engine.blocks_per_chunk
            tail_blocks = -(-pieces.tail // layout.block_size)
            for i, chunk in enumerate(pinned):
                blocks = per_chunk if i < pieces.whole else tail_blocks
                nbytes = layout.state_bytes if i >= len(keys) else blocks * layout.block_bytes
                if chunk.fingerprint != layout.fingerprint or chunk.nbytes != nbytes:
                    raise LayoutMismatch("a requested chunk was stored by an engine with a "
                                         "different KV cache layout; it cannot be loaded here")
            # Per group, blocks shared with the engine's prefix cache and blocks it does
            # not hold (before a sliding window) are left out.
            whole_blocks = pieces.whole * per_chunk
            copies = []
            if pieces.whole:
                copies.append(self._group_copies(engine, [
                    group.plan(block_ids[:whole_blocks], per_chunk,
                               first_slot=min(max(skip // layout.block_size, unheld),
                                              whole_blocks))
                    for group, (block_ids, unheld) in zip(layout.token_groups, pieces.groups,
                                                          strict=True)
                ], pinned[:pieces.whole], per_chunk))
            if pieces.tail:
                block_ids, unheld = pieces.groups[0]
                first = max(skip // layout.block_size, unheld) - whole_blocks
                copies.append(self._group_copies(engine, [layout.groups[0].plan(
                    block_ids[whole_blocks:], tail_blocks, first_slot=max(first, 0))],
                    pinned[pieces.whole:len(keys)], tail_blocks))
            if pieces.state is not None:
                copies.append(self._state_copies(engine, pieces, pinned[-1]))
            with engine.fence.hold(request.fence_slot, request.fence_generation):
                for groups in copies:
                    engine.copier.scatter(groups, request.event_handle)
        except OperationCancelled:
            self.metrics.add(cancelled_operations=1)
            raise
        finally:
            self.tier.unpin(pinned)
        self.lookups.release_reads(session_key(engine.tenant, request.request_id), read)
        self.metrics.add(retrieves=1, retrieved_chunks=pieces.whole,
                         retrieved_tails=len(keys) - pieces.whole,
                         retrieved_states=len(read) - len(keys),
                         retrieved_tokens=request.end - request.start - skip,
                         retrieved_bytes=sum(chunk.nbytes for chunk in pinned),
                         retrieve_seconds=time.perf_counter() - started)
        return RetrieveResult(retrieved=len(read))
