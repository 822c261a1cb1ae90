"""The control path: lookups, the promotions that extend them, and their locks.

Stores and retrieves move KV bytes (`DataPath`); this side only answers which leading
chunks of a prompt the server holds, locks them for the retrieve that follows, and reads
up from the lower tiers what CPU memory lacks. It is handed what it works with: the CPU
tier, the lookup table, the lower tiers and the drain; it owns the promotion threads.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from kvdepot.errors import InvalidRequest
from kvdepot.keys import (
    HASH_BYTES,
    ChunkKey,
    iter_prefix_keys,
    rank_key,
    scope_root,
    state_key,
    tail_keys,
)
from kvdepot.log_limiter import LogLimiter
from kvdepot.metrics import MetricsRegistry
from kvdepot.protocol import EndSession, FreeLookupLocks, Lookup, QueryPrefetchStatus, unpack_ints
from kvdepot.rpc.auth import Caller
from kvdepot.server.block_event_log import BlockEventLog, hash_width
from kvdepot.server.drain import Drain
from kvdepot.server.lookups import LookupJob, LookupTable, session_key
from kvdepot.storage.chunk import ChunkScope
from kvdepot.storage.cpu_tier import CPUTier
from kvdepot.storage.lower_tiers import LowerTiers

log = logging.getLogger(__name__)
bad_input_log = LogLimiter(log)


class _Wanted(NamedTuple):
    """The vLLM block hashes of the chunks a promotion may bring up."""

    blocks: bytes
    first: int
    """The promotion's candidate (0: the first) that `blocks` start with; a negative
    one: that many chunks of `blocks` lie before the candidates."""
    per_chunk: int
    width: int
    block_size: int
    parent: bytes | None
    """The hash of the block before `blocks`."""


MAX_TAIL_CANDIDATES = 32
"""Tails a lookup hashes and asks for at most after its whole chunks, longest first: a
prompt's tokens past a popular prefix may end at many places, and each costs a hash."""


class _TailSearch(NamedTuple):
    """What finding the tail of a lookup's hit needs: the prompt and its scope."""

    tokens: np.ndarray
    root: bytes
    world_size: int
    chunk_size: int

    def candidates(self, chunks: list[list[ChunkKey]], held: Callable[[bytes], list[int]],
                   whole_rest: bool = False) -> tuple[bytes, list[int], list[list[ChunkKey]]]:
        """The tails that could follow the whole chunks `chunks` (each its keys on every
        rank), longest first, at most `MAX_TAIL_CANDIDATES`: those of the lengths CPU
        memory holds after them (`held`, by parent) that fit the prompt, and with
        `whole_rest` the prompt's whole rest if it is shorter than a chunk (the lower
        tiers keep no index of lengths: there a tail is found when its prompt comes
        again). Returns the chain hash they follow, their lengths and their keys."""
        parent = chunks[-1][0][:HASH_BYTES] if chunks else self.root
        at = len(chunks) * self.chunk_size
        rest = len(self.tokens) - at
        lengths = [n for n in held(parent) if n <= rest]
        if whole_rest and 0 < rest < self.chunk_size and rest not in lengths:
            lengths = sorted([*lengths, rest], reverse=True)
        lengths = lengths[:MAX_TAIL_CANDIDATES]
        return parent, lengths, tail_keys(parent, self.tokens, at, lengths,
                                          range(self.world_size))


class ControlPath:
    """The handlers of LOOKUP, QUERY_PREFETCH_STATUS, FREE_LOOKUP_LOCKS and END_SESSION."""

    def __init__(self, chunk_size: int, tier: CPUTier, lookups: LookupTable,
                 lower: LowerTiers, drain: Drain, metrics: MetricsRegistry,
                 promotion_threads: int, block_events: BlockEventLog | None = None) -> None:
        """`block_events`: where the hashes of chunks a lookup may promote are kept."""
        self.chunk_size = chunk_size
        self.block_events = block_events
        self.tier = tier
        self.lookups = lookups
        self.lower = lower
        self.drain = drain
        self.metrics = metrics
        # Promotions wait on disk or network; they get threads of their own so they never
        # hold up a store or retrieve.
        self._promotions = ThreadPoolExecutor(promotion_threads,
                                              thread_name_prefix="kvdepot-promote")

    def close(self) -> None:
        """Cancel promotions not started and wait for those running (before the lower
        tiers close under them)."""
        self._promotions.shutdown(wait=True, cancel_futures=True)

    def lookup(self, request: Lookup, caller: Caller) -> int | None:
        """Locks the hit and returns its chunk count (None: a promotion is under way, ask
        again with QUERY_PREFETCH_STATUS)."""
        peer = caller.connection
        tenant = caller.identity.tenant
        session = session_key(tenant, request.request_id)
        if self.drain.active:
            self.metrics.add(lookups=1, lookups_refused_draining=1)
            return 0
        if not self.lookups.has_room(peer, session, tenant):
            self.metrics.add(lookups=1, lookups_refused=1)
            bad_input_log.warning("lookup-jobs", "a connection (or its tenant) has the most "
                                  "lookup jobs open (%d, %d); further lookups answer 0 until "
                                  "some end", self.lookups.max_jobs,
                                  self.lookups.max_tenant_jobs)
            return 0
        cs = self.chunk_size
        tokens = unpack_ints(request.token_ids)
        # Every whole chunk: the engine decides how much of the hit it loads (it computes
        # at least the prompt's last token itself, and may load the last chunk partly).
        wanted = len(tokens) // cs
        # Lazy: hashing stops soon after the first chunk missing from CPU memory.
        # The tenant comes from the credential, never from the request.
        root = scope_root(request.scope, tenant)
        wanted_keys = iter_prefix_keys(root, tokens, cs, wanted, request.scope.world_size)
        tails = (_TailSearch(tokens, root, request.scope.world_size, cs)
                 if request.tails else None)
        reply_unit = cs if tails else 0  # LookupJob.reply_chunk_tokens
        readers = request.readers_per_key
        # What a promotion needs, whichever path starts one.
        scope = ChunkScope(tenant, request.scope.model, request.scope.cache_salt)
        rate = request.prefill_tokens_per_s
        compute_seconds = cs / rate if rate else None
        # Checked before anything is locked: a bad lookup changes nothing.
        if request.tails and request.states:
            # A tail's blocks would follow a state that ends the hit before them.
            raise InvalidRequest("a lookup asks for tails or for recurrent states, not both")
        first_hashed = request.hashes_first_chunk
        width = 0
        if request.block_hashes and self.block_events is not None:
            if first_hashed >= wanted:
                raise InvalidRequest(f"hashes_first_chunk {first_hashed} is past the "
                                     f"{wanted} whole chunks looked up")
            width = hash_width(request.block_hashes, request.hash_block_size,
                               (wanted - first_hashed) * cs, cs)
        hit, first_missing = self.tier.lock_prefix(wanted_keys, readers)
        # With every lower tier unreachable (breakers open) the lookup is answered now,
        # from CPU memory alone, rather than through a promotion that would find nothing.
        # So is a hybrid model's: its states are looked for in CPU memory only.
        if first_missing is not None and self.lower.reachable() and not request.states:
            job = self.lookups.start(session, hit, readers, complete=False, peer=peer,
                                     tenant=tenant, reply_chunk_tokens=reply_unit)
            self._count_capped(job)
            self.metrics.add(lookups=1, lookup_requested_tokens=len(tokens))
            if not job.capped:
                # The rest of the chain is hashed on the promotion thread, as far as it gets.
                parent = hit[-1][0][:HASH_BYTES] if hit else None
                hashes = None
                if width:
                    per_chunk = len(request.block_hashes) // (wanted - first_hashed)
                    hashes = _Wanted(bytes(request.block_hashes), first_hashed - len(hit),
                                     per_chunk, width, request.hash_block_size,
                                     bytes(request.hashes_parent) or None)
                self._promotions.submit(self._promote, job,
                                        itertools.chain([first_missing], wanted_keys), readers,
                                        scope, parent, compute_seconds, hashes, tails)
                return None
            self.lookups.finish(job)
        else:
            job = self.lookups.start(session, hit, readers, peer=peer, tenant=tenant,
                                     reply_chunk_tokens=reply_unit)
            self._count_capped(job)
            self.metrics.add(lookups=1, lookup_requested_tokens=len(tokens))
            if request.states:
                self._end_at_state(job, request.scope.world_size, readers)
            if tails is not None and not job.capped:
                self._lock_held_tail(job, tails, readers)
                if not job.tail and self._tail_below(tails, job.chunk_keys):
                    # The prompt's tail is on disk: read it up, as a promotion.
                    job.hit_chunks = None
                    self._promotions.submit(self._promote, job, iter(()), readers, scope,
                                            None, compute_seconds, None, tails)
                    return None
        self._count_hit(job)
        job.answered = True
        return job.reply()

    def query(self, request: QueryPrefetchStatus, caller: Caller) -> int | None:
        return self.lookups.query(session_key(caller.identity.tenant, request.request_id))

    def free_locks(self, request: FreeLookupLocks, caller: Caller) -> None:
        cs = self.chunk_size
        if request.start < 0 or request.end < request.start:
            raise InvalidRequest(f"bad range [{request.start}, {request.end})")
        self.lookups.release_range(session_key(caller.identity.tenant, request.request_id),
                                   request.start, request.end, cs)

    def end_session(self, request: EndSession, caller: Caller) -> None:
        self.lookups.end(session_key(caller.identity.tenant, request.request_id))

    def _learn_hashes(self, chunks: list[list[bytes]], hashes: _Wanted, tenant: str,
                      parent: bytes | None) -> None:
        """Give the block event log the hashes of the candidates they cover, before any
        is brought up (rank 0's keys lead each chunk's list)."""
        first = max(hashes.first, 0)
        skipped = first - hashes.first  # chunks of `blocks` before the candidates
        offset = skipped * hashes.per_chunk
        count = min(len(chunks) - first, len(hashes.blocks) // hashes.per_chunk - skipped)
        if count <= 0 or self.block_events is None:
            return
        previous = (chunks[first - 1][0] if first else
                    rank_key(parent, 0) if parent is not None else None)
        # The block before the first learnt: the one before `blocks`, or inside them.
        before = (hashes.blocks[offset - hashes.width:offset] if offset else hashes.parent)
        self.block_events.learn([keys[0] for keys in chunks[first:first + count]], tenant,
                                hashes.blocks[offset:offset + count * hashes.per_chunk],
                                hashes.width, hashes.block_size, previous, before)

    def _lock_held_tail(self, job: LookupJob, tails: _TailSearch, readers: int) -> None:
        """End the hit of a lookup answered from CPU memory with the longest tail CPU
        memory holds after it (lower tiers are not asked: a lookup never waits on them
        for a tail, less than a chunk, when CPU memory held every chunk before it)."""
        _, lengths, candidates = tails.candidates(job.chunk_keys, self.tier.tail_lengths)
        for length, keys in zip(lengths, candidates, strict=True):
            locked, _ = self.tier.lock_prefix([keys], readers)
            if locked:
                if self.lookups.extend(job, keys, readers, tail=length):
                    self.lookups.finish(job)
                else:
                    self._count_capped(job)
                return

    def _tail_below(self, tails: _TailSearch, chunks: list[list[ChunkKey]]) -> bool:
        """Whether a lower tier that answers from memory (the disk tier's index) holds the
        tail of the prompt's whole rest after `chunks`. The shared tier is not asked: a
        lookup answered from CPU memory never waits on a round trip for a tail."""
        if not self.lower.reachable():
            return False
        _, _, candidates = tails.candidates(chunks, lambda _: [], whole_rest=True)
        return bool(candidates) and self.lower.hold_without_io(candidates[0])

    def _end_at_state(self, job: LookupJob, world_size: int, readers: int) -> None:
        """End a hybrid model's hit at its last chunk whose end state CPU memory holds on
        every rank, locking that state with the chunks before it: a recurrent layer
        cannot start after a chunk without the state there, so the chunks past it are
        given back (and a hit without any state is a miss)."""
        held = len(job.chunk_keys)
        for whole in range(held, 0, -1):
            chain_hash = job.chunk_keys[whole - 1][0][:HASH_BYTES]
            keys = [state_key(chain_hash, rank) for rank in range(world_size)]
            locked, _ = self.tier.lock_prefix(iter([keys]), readers)
            if locked:
                self.lookups.end_at_state(job, whole, keys, readers)
                break
        else:
            self.lookups.end_at_state(job, 0, [], readers)
        if job.whole_chunks < held:
            self.metrics.add(hits_cut_to_state=1)

    def _count_hit(self, job: LookupJob) -> None:
        self.metrics.add(hit_chunks=job.whole_chunks, hit_tokens=job.hit_tokens(self.chunk_size),
                         hit_tails=1 if job.tail else 0, hit_tail_tokens=job.tail,
                         hit_states=1 if job.state else 0)

    def _count_capped(self, job: LookupJob) -> None:
        if job.capped:
            self.metrics.add(lookups_lock_capped=1)
            bad_input_log.warning("locked-share", "a tenant's lookups hold %d bytes locked, "
                                  "the most one tenant may; a lookup locked a shorter prefix",
                                  self.lookups.locked_bytes(job.tenant))

    def _promote(self, job: LookupJob, candidates: Iterable[list[bytes]], readers: int,
                 scope: ChunkScope, parent: bytes | None,
                 compute_seconds_per_chunk: float | None, hashes: _Wanted | None,
                 tails: _TailSearch | None) -> None:
        """Extend a lookup's hit with chunks read up from lower tiers, in prefix order, as
        far as loading them beats computing them (on a promotion thread), then with the
        longest tail any tier holds after them (`tails`: None when the engine loads no
        tails). `hashes`: the vLLM block hashes of the candidates, which block events
        report them under."""
        try:
            chunks = list(candidates)
            if hashes is not None and self.block_events is not None:
                self._learn_hashes(chunks, hashes, scope.tenant, parent)
            # The tails that would follow every candidate chunk are asked for and read
            # with them: a hit that ends in a tail costs no round trip more.
            before, lengths, after_all = (tails.candidates([*job.chunk_keys, *chunks],
                                                           self.tier.tail_lengths,
                                                           whole_rest=True)
                                          if tails is not None else (None, [], []))
            cs = self.chunk_size
            tail_compute = (None if compute_seconds_per_chunk is None else
                            [compute_seconds_per_chunk * length / cs for length in lengths])
            run, held, tail = self.lower.bring_up_prefix(
                chunks, readers, scope, parent if chunks else before,
                compute_seconds_per_chunk, after_all, tail_compute)
            extended = 0
            for keys in chunks[:run]:
                if not self.lookups.extend(job, keys, readers):
                    self._count_capped(job)
                    break
                extended += 1
            locked_after = chunks[extended + 1:run] if extended < run else []
            if tail is not None:
                if extended == run:
                    if not self.lookups.extend(job, after_all[tail], readers,
                                               tail=lengths[tail]):
                        self._count_capped(job)
                else:
                    locked_after.append(after_all[tail])
            for keys in locked_after:
                self.tier.unlock(dict.fromkeys(keys, readers))
            # A tail after a shorter run (the chunks after it are nowhere) can only be one
            # CPU memory holds; only when every chunk before it is loaded (none was left
            # as slower to load than compute).
            if tails is not None and run == held < len(chunks) and not job.capped:
                self._promote_tail(job, tails, readers, scope, compute_seconds_per_chunk)
        except Exception:
            log.exception("reading lower tiers for lookup %s failed", job.request_id)
        finally:
            self.lookups.finish(job)
            self._count_hit(job)

    def _promote_tail(self, job: LookupJob, tails: _TailSearch, readers: int,
                      scope: ChunkScope, compute_seconds_per_chunk: float | None) -> None:
        before, lengths, candidates = tails.candidates(job.chunk_keys, self.tier.tail_lengths,
                                                       whole_rest=True)
        if not candidates:
            return
        cs = self.chunk_size
        compute = (None if compute_seconds_per_chunk is None else
                   [compute_seconds_per_chunk * length / cs for length in lengths])
        index = self.lower.bring_up_first(candidates, readers, scope, before, compute)
        if index is not None and not self.lookups.extend(job, candidates[index], readers,
                                                         tail=lengths[index]):
            self._count_capped(job)
