"""Scheduler-side half of the connector: lookups, lock release and transfer planning.

Everything here runs inside vLLM's scheduler loop, so no call may block for
long and no exception from the kvdepot client may escape into vLLM: a broken
cache server must only cost cache hits, never requests.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvdepot.client.block_event_poller import BlockEventPoller
from kvdepot.client.engine_types import BlockAllocationRecord
from kvdepot.client.scheduler import MIN_TAIL_TOKENS, SchedulerClient
from kvdepot.client.worker import held_blocks, written_blocks
from kvdepot.errors import InvalidRequest
from kvdepot.integrations.vllm.block_events_for_vllm import vllm_events
from kvdepot.integrations.vllm.load_time import LoadTime, load_pays
from kvdepot.integrations.vllm.metadata import (
    KVDepotConnectorMetadata,
    StagedLoad,
    TransferSpec,
    load_store_op,
)
from kvdepot.integrations.vllm.offered_chunks import OfferedChunks
from kvdepot.integrations.vllm.prefill_rate import PrefillRate
from kvdepot.keys import validate_cache_salt
from kvdepot.log_limiter import LogLimiter
from kvdepot.protocol import NO_BLOCK

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvdepot.integrations.vllm.staging import StagingArea


log = logging.getLogger(__name__)

T = TypeVar("T")


class Phase(enum.Enum):
    LOOKUP = enum.auto()
    """Waiting for vLLM to allocate blocks; a lookup may be in flight and may
    hold read locks on the server."""
    ALLOCATED = enum.auto()
    """Blocks allocated and the load (if any) planned; no lookup locks left."""


@dataclass
class RequestTracker:
    """The connector's view of one request, from arrival to finish."""

    request_id: str
    cache_salt: str
    token_ids: Sequence[int]
    """Live, read-only view of the request's tokens; grows as tokens are sampled."""
    block_hashes: Sequence[bytes]
    """Live view of vLLM's hashes of the request's full blocks."""
    prompt_len: int
    cacheable: bool
    """False when token ids do not name the content (prompt embeddings)."""
    round: int = -1
    """vLLM's preemption count when the current lookup round began; a preempted
    request is looked up again from scratch."""
    phase: Phase = Phase.LOOKUP
    lookup_tokens: int = 0
    """Tokens sent in the current lookup, 0 when none was sent."""
    external_hit: int | None = None
    """The server's answer, None while pending or when no lookup was sent."""
    local_hit: int = 0
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV cache group, the request's blocks in token order (vLLM's null block where
    a sliding window has let a block go)."""
    stored_end: int = 0
    """Tokens [0, stored_end) are stored or known to be on the server (whole chunks)."""
    tail_end: int = 0
    """Where the tail stored or loaded last ends (0: none): a tail is stored once."""
    load_start: int = 0
    load_block_ids: frozenset[int] = frozenset()
    """Where a retrieve of this request starts and the blocks it writes (the only ones
    its failure is reported for), so a failed retrieve can be traced back and its chunks
    stored again after recompute."""
    has_stores: bool = False
    """Sticky across preemptions: the worker may still hold stores of this id."""
    talked_to_server: bool = False
    inline: bool = False
    """Its load is synchronous (`SchedulerSide._loads_inline`): the request runs in the
    step that loads it."""
    staged: tuple[int, int, int] | None = None
    """(start, end, first slot) of its load, already in the staging area's slots from the
    first one on (`SchedulerSide._stage`)."""

    def start_round(self, num_preemptions: int) -> None:
        self.round = num_preemptions
        self.phase = Phase.LOOKUP
        self.lookup_tokens = 0
        self.external_hit = None
        self.local_hit = 0
        self.block_ids = []
        self.stored_end = 0
        self.tail_end = 0
        self.load_start = 0
        self.load_block_ids = frozenset()
        self.inline = False
        self.staged = None


def _salt_for(request: Request) -> str:
    """The key scope of a request: its cache_salt plus whatever else changes its KV.

    The same token ids yield different KV under another LoRA adapter or with
    other images behind the placeholder tokens, so those must not share entries.
    """
    parts = [request.cache_salt or ""]
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={lora.lora_name}")
    for feature in getattr(request, "mm_features", None) or ():
        offset = getattr(getattr(feature, "mm_position", None), "offset", "")
        parts.append(f"mm={feature.identifier}@{offset}")
    return parts[0] if len(parts) == 1 else "|".join(parts)


_bad_input_log = LogLimiter(log)


def _completed(request: Request) -> bool:
    """Whether `request` ended at a step's output (a stop, its length, ...), not aborted,
    failed or never run."""
    status = getattr(getattr(request, "status", None), "name", "")
    return status.startswith("FINISHED_") and status not in (
        "FINISHED_ABORTED", "FINISHED_ERROR", "FINISHED_IGNORED")


def _usable_salt(salt: str) -> bool:
    """Whether the server would take `salt` in a key scope. A salt it refuses (too
    long, control characters: any client can send one) makes the request run without
    the cache, decided here once: no lookup or store of it reaches the server, so one
    hostile request costs neither a round trip nor an error per chunk, and the engine
    never sees an exception of ours."""
    try:
        validate_cache_salt(salt)
    except InvalidRequest as exc:
        _bad_input_log.warning("salt", "kvdepot: a request runs without the cache: %s", exc)
        return False
    return True


NULL_BLOCK = 0
"""vLLM's placeholder block (the block pool's first): a sliding-window group's entry for
a block outside the window, which holds no KV of the request."""


def _groups(block_ids: tuple[list[int], ...] | None, num_groups: int) -> list[list[int]]:
    """vLLM's per-group block ids (None or empty: no new blocks) as one list per group."""
    if not block_ids:
        return [[] for _ in range(num_groups)]
    return [list(group) for group in block_ids]


def _held(groups: list[list[int]]) -> list[list[int]]:
    """A load's block lists with vLLM's null blocks marked as blocks not to write."""
    return [[NO_BLOCK if b == NULL_BLOCK else b for b in group] for group in groups]


class SchedulerSide:
    """Tracks requests for the scheduler and turns their progress into transfers."""

    def __init__(
        self,
        client: SchedulerClient,
        block_size: int,
        can_load: bool,
        can_store: bool,
        store_generated: bool,
        report_block_allocations: bool,
        num_groups: int = 1,
        frees_blocks_early: bool = False,
        skip_slow_loads: bool = True,
        block_events: bool = False,
        tails: bool = False,
        inline_loads: bool = False,
        state_groups: tuple[int, ...] = (),
        wait_idle_loads: bool = False,
        steps_in_flight: int = 1,
        staging_area: Callable[[], StagingArea | None] | None = None,
    ) -> None:
        """`block_events`: the engine publishes KV events; stores then carry the blocks'
        hashes and the server's block events join the engine's (`take_events`).
        `tails`: prompts' tokens past their last whole chunk are stored and loaded too
        (one KV cache group only). `inline_loads`: a load planned while no other request
        runs is synchronous (`_loads_inline`; one KV cache group only).
        `wait_idle_loads`: the worker waits for the asynchronous loads of a step that
        computes nothing within that step (`build_meta`). `steps_in_flight`: how many
        steps vLLM keeps queued (`prefill_rate.steps_in_flight`). `staging_area`: the
        worker's staging area, if it has one in this process (`staging`), for loads
        that would otherwise be asynchronous on an idle engine; given only where the
        connector stages loads (one KV cache group, no state groups). `state_groups`:
        the groups of recurrent layers, whose block i holds the state after block i's
        last token (vLLM's "align" prefix caching): a hit then ends where a state was
        stored, and loads it (`_state_block`)."""
        self._client = client
        self._block_events = BlockEventPoller(client) if block_events else None
        self._num_groups = num_groups
        """vLLM's KV cache groups: more than one with sliding-window layers (its hybrid
        KV cache manager)."""
        self._frees_early = frees_blocks_early
        """Some group is a sliding window (or chunked local attention): vLLM frees its
        blocks while the request runs and puts its null block in their place."""
        self._block_size = block_size
        self._chunk = client.chunk_size
        self._can_load = can_load
        self._can_store = can_store
        self._store_generated = store_generated
        self._report_allocations = report_block_allocations
        self._trackers: dict[str, RequestTracker] = {}
        self._loads: list[TransferSpec] = []
        self._failed_loads: dict[str, list[int]] = {}
        self._inline_failed_loads: list[str] = []
        self._delayed_free: list[str] = []
        self._prefill = PrefillRate(min_tokens=self._chunk, steps_in_flight=steps_in_flight)
        self._load_time = LoadTime()
        self._skip_slow_loads = skip_slow_loads
        self._tails = tails and num_groups == 1
        self._inline_loads = inline_loads and num_groups == 1
        self._wait_idle_loads = wait_idle_loads
        self._staging_area = staging_area
        self._staged: list[StagedLoad] = []
        self._moving: list[str] = []
        """Requests whose staged blocks the step being built moves."""
        self._moving_before: list[str] = []
        """Those of the step built last: their slots stay taken until the next step is
        built, which comes after that move was queued (and a copy into slots waits for
        the stream it was queued on)."""
        self._scheduled: set[str] = set()
        """Requests the last step computed, less those finished since."""
        self._state_groups = state_groups
        # A chunk's recurrent state is stored with it or not at all, so with state groups
        # a chunk the server holds may still lack its state: those stores are never skipped.
        self._offered = None if state_groups else OfferedChunks()
        self._telemetry_group = next((g for g in range(max(num_groups, 1))
                                     if g not in state_groups), 0)
        """An attention group, whose blocks hold the request's tokens (a state group's
        hold states), for the block allocations reported."""

    # ---- vLLM hooks ------------------------------------------------------

    def on_new_request(self, request: Request) -> RequestTracker:
        tracker = self._trackers.get(request.request_id)
        if tracker is None:
            # Prompt embeddings: the token ids are placeholders, not content.
            is_token = getattr(request, "prompt_is_token_ids", None)
            embeds = request.prompt_token_ids is None or (
                is_token is not None and not all(is_token)
            )
            salt = _salt_for(request)
            tracker = RequestTracker(
                request_id=request.request_id,
                cache_salt=salt,
                token_ids=request.all_token_ids,
                block_hashes=getattr(request, "block_hashes", ()),
                prompt_len=request.num_prompt_tokens,
                cacheable=not embeds and _usable_salt(salt),
            )
            self._trackers[request.request_id] = tracker
        return tracker

    def may_load(self, request: Request) -> bool:
        """Whether a lookup of `request` could end in a load (vLLM 0.34's `may_load_async`):
        it is asked as the request is queued, so it sends nothing to the server and cannot
        know the hit. True for every request a lookup would be sent for whose prompt holds
        at least one whole chunk (or tail) before its last token, while the server answers.
        A miss among them costs only what vLLM's default costs every request: while the
        batch is full it waits at the head of vLLM's queue of such requests, and the loads
        behind it start once a running slot frees."""
        if not self._can_load or not self._client.is_healthy:
            return False
        tracker = self.on_new_request(request)
        smallest = MIN_TAIL_TOKENS if self._tails else self._chunk
        return tracker.cacheable and self._load_end(tracker, self._lookup_len(tracker)) >= smallest

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracker = self.on_new_request(request)
        if tracker.round != request.num_preemptions:
            tracker.start_round(request.num_preemptions)
        if not (self._can_load and tracker.cacheable) or tracker.phase is not Phase.LOOKUP:
            return 0, False

        # Recomputed from scratch on every call: vLLM asks again whenever it
        # could not allocate, and its own prefix hit may have changed since.
        tracker.local_hit = num_computed_tokens
        num_tokens = self._lookup_len(tracker)
        if self._state_groups:
            # A hit ends at a chunk whose end state is loaded, and vLLM computes at least
            # the last token: the hit's chunks lie within the tokens before it.
            num_tokens = min(num_tokens, len(tracker.token_ids) - 1)
        # The server answers every whole chunk it holds (and with tails, the longest
        # tail after them); vLLM must compute at least the last token itself, so the
        # most it can load ends one before.
        rest = num_tokens % self._chunk
        max_hit = num_tokens - (0 if self._tails and rest >= MIN_TAIL_TOKENS else rest)
        if tracker.lookup_tokens == 0:
            most = self._load_end(tracker, max_hit)
            if most <= num_computed_tokens:
                return 0, False
            if not self._worth_loading(most, num_computed_tokens):
                return 0, False  # not even the most a lookup could find: no round trip
            if not self._submit_lookup(tracker, num_tokens):
                return 0, False

        if tracker.external_hit is None:
            result = self._call(self._client.check_lookup_result, 0, tracker.request_id)
            if result is None:
                # Never block the scheduler on the server: vLLM asks again
                # next step and schedules other requests meanwhile.
                return None, False
            self._learn_held(tracker, result, num_tokens)
            hit = min(result if self._tails else result - result % self._chunk, max_hit)
            if hit < result:
                self._free_locks(tracker, hit, result)
            tracker.external_hit = hit

        need = max(0, self._load_end(tracker, tracker.external_hit) - num_computed_tokens)
        if not need or not self._worth_loading(num_computed_tokens + need, num_computed_tokens):
            return 0, False
        tracker.inline = self._loads_inline(tracker) or self._stage(tracker, need)
        return need, not tracker.inline

    def _loads_inline(self, tracker: RequestTracker) -> bool:
        """Whether `tracker`'s load should be synchronous: vLLM then schedules the request
        at once and the worker loads it before the step's forward, so it skips the two or
        more engine steps an asynchronous load takes (one carries it out; after the copy,
        one carries the news back and the next schedules the request). Only while no other
        request is running: their step would wait for the copy. A request arriving in the
        same step waits with it, as it would behind a long prefill."""
        return self._inline_loads and not (self._scheduled - {tracker.request_id})

    def _stage(self, tracker: RequestTracker, need: int) -> bool:
        """Copy the load of `need` tokens after vLLM's own hit into the worker's staging
        area, if it has one and the engine is idle; True once the copy is there, so the
        load is synchronous and cannot fail (`staging`). On False the load stays
        asynchronous. Blocks the scheduler for the copy, as a synchronous load blocks the
        step: only while no other request runs."""
        area = self._area()
        bs, cs = self._block_size, self._chunk
        start = tracker.local_hit // cs * cs
        end = tracker.local_hit + need
        if tracker.staged is not None:
            if (area is not None and tracker.staged[:2] == (start, end)
                    and area.holds(tracker.request_id)):
                return True  # staged when vLLM last asked; it could not allocate then
            self._release_staged(tracker)  # another range, or the area is gone
        if area is None or self._scheduled - {tracker.request_id}:
            return False
        count = -(-end // bs) - start // bs
        first = area.reserve(tracker.request_id, count)
        if first is None:
            return False
        hit = tracker.external_hit or 0
        whole_hit = hit - hit % cs
        spec = self._spec(tracker, start, end, skip=tracker.local_hit - start,
                          tail=hit - whole_hit if end > whole_hit else 0)
        spec.block_ids = [list(range(first, first + count))]
        self._load_time.planned(tracker.request_id, need)
        staged = area.stage(spec)
        self._load_time.received(tracker.request_id)
        if not staged:
            area.release(tracker.request_id)
            return False
        tracker.staged = (start, end, first)
        return True

    def _release_staged(self, tracker: RequestTracker) -> None:
        """Give up `tracker`'s staged load, never moved: its slots are free again."""
        if tracker.staged is None:
            return
        tracker.staged = None
        if (area := self._area()) is not None:
            area.release(tracker.request_id)

    def _area(self) -> StagingArea | None:
        """The worker's staging area, if this engine has one now."""
        return self._staging_area() if self._staging_area is not None else None

    def _worth_loading(self, end: int, local_hit: int) -> bool:
        """Whether loading [local_hit, end) makes the request ready sooner than computing
        it. Only where vLLM holds a prefix: then a load is all the request would wait for
        (a prompt's tail on a GPU computes in a fraction of a load's round trips)."""
        if not (local_hit and self._skip_slow_loads):
            return True
        return load_pays(end - local_hit, self._prefill.tokens_per_s, self._load_time)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        tracker = self.on_new_request(request)
        # `blocks` is every block of the request, not only the new ones.
        tracker.block_ids = _groups(blocks.get_block_ids(), self._num_groups)
        if tracker.phase is not Phase.LOOKUP:
            return
        tracker.phase = Phase.ALLOCATED
        hit = tracker.external_hit or 0
        if tracker.lookup_tokens:
            self._call(self._client.cleanup_lookup_result, None, tracker.request_id)
        whole_hit = hit - hit % self._chunk
        tracker.stored_end = whole_hit
        tracker.tail_end = hit if hit > whole_hit else 0

        end = tracker.local_hit + num_external_tokens
        if num_external_tokens <= 0:
            self._release_staged(tracker)
            self._free_locks(tracker, 0, hit)
            return
        if end != self._load_end(tracker, hit):
            # vLLM only ever takes all or nothing of what we offered; anything
            # else means the plan no longer matches the locked chunks.
            log.error(
                "kvdepot: request %s: vLLM expects %d external tokens after %d local, "
                "but %d were offered; loading nothing",
                tracker.request_id, num_external_tokens, tracker.local_hit,
                self._load_end(tracker, hit) - tracker.local_hit,
            )
            self._release_staged(tracker)
            self._free_locks(tracker, 0, hit)
            self._failed_loads[tracker.request_id] = self._expected_blocks(tracker, end)
            if tracker.inline:
                self._inline_failed_loads.append(tracker.request_id)
            return
        # The chunk that straddles vLLM's own hit is read minus the shared
        # blocks; chunks wholly inside vLLM's hit are never read. When the
        # load ends one token before a chunk-aligned prompt's end, its last
        # chunk is read whole and only the blocks vLLM allocated are written.
        start = tracker.local_hit // self._chunk * self._chunk
        self._free_locks(tracker, 0, start)
        tail = hit - whole_hit if end > whole_hit else 0
        if hit > whole_hit and not tail:
            self._free_locks(tracker, whole_hit, hit)  # the load ends before its tail
        spec = self._spec(tracker, start, end, skip=tracker.local_hit - start, tail=tail,
                          with_state=bool(self._state_groups))
        if self._state_groups and any(spec.block_ids[g] == [NULL_BLOCK]
                                      for g in self._state_groups):
            # vLLM gave the state after the hit no block: nothing could load it.
            log.error("kvdepot: request %s: vLLM holds no block for the recurrent state "
                      "after token %d; loading nothing", tracker.request_id, end)
            self._free_locks(tracker, 0, hit)
            self._failed_loads[tracker.request_id] = self._expected_blocks(tracker, end)
            return
        spec.block_ids = _held(spec.block_ids)
        spec.inline = tracker.inline
        tracker.load_start = start
        if tracker.staged is not None:
            if tracker.staged[:2] == (start, end):
                # Moved out of the staging area by the worker before the forward: the
                # blocks the load writes (past vLLM's own hit), each from its slot.
                shared = spec.skip_first_n_tokens // self._block_size
                self._staged.append(StagedLoad(
                    tracker.request_id, tracker.staged[2] + shared,
                    written_blocks(load_store_op(spec), self._block_size)))
                self._moving.append(tracker.request_id)
                tracker.staged = None
                return
            # Never expected: both ends come from the same offer as `end` above.
            log.error("kvdepot: request %s: its staged load no longer matches what vLLM "
                      "allocated; loading nothing", tracker.request_id)
            self._release_staged(tracker)
            self._free_locks(tracker, 0, hit)
            self._failed_loads[tracker.request_id] = self._expected_blocks(tracker, end)
            self._inline_failed_loads.append(tracker.request_id)
            return
        shared = spec.skip_first_n_tokens // self._block_size
        tracker.load_block_ids = frozenset(held_blocks(
            group if number in spec.state_groups else group[shared:]
            for number, group in enumerate(spec.block_ids)))
        self._loads.append(spec)
        if not spec.inline:  # the line is of asynchronous waits, steps included
            self._load_time.planned(tracker.request_id, end - tracker.local_hit)

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVDepotConnectorMetadata:
        if self._moving_before and (area := self._area()) is not None:
            for request_id in self._moving_before:
                area.release(request_id)
        self._moving_before, self._moving = self._moving, []
        meta = KVDepotConnectorMetadata(
            loads=self._loads,
            staged=self._staged,
            failed_loads=self._failed_loads,
            inline_failed_loads=self._inline_failed_loads,
            preempted_req_ids=sorted(scheduler_output.preempted_req_ids or ()),
            delayed_free_req_ids=self._delayed_free,
        )
        self._loads = []
        self._staged = []
        self._failed_loads = {}
        self._inline_failed_loads = []
        self._delayed_free = []
        scheduled = scheduler_output.num_scheduled_tokens
        records: list[Any] = []
        # Blocks given out this step: a sliding window may have freed them while a
        # store still reads them (see KVDepotConnectorMetadata.reused_block_ids).
        reused: set[int] = set()
        for load in meta.loads:
            reused.update(held_blocks(load.block_ids))
        for expected in meta.failed_loads.values():
            reused.update(expected)  # vLLM recomputes into them this step

        for new_req in scheduler_output.scheduled_new_reqs:
            tracker = self._trackers.get(new_req.req_id)
            if tracker is None:
                continue
            tracker.block_ids = _groups(new_req.block_ids, self._num_groups)
            # Blocks before its computed tokens are prefix hits (only read) or blocks a
            # load already claimed (counted when that load was planned).
            fresh = new_req.num_computed_tokens // self._block_size
            reused.update(b for group in tracker.block_ids for b in group[fresh:])
            computed = new_req.num_computed_tokens + scheduled.get(new_req.req_id, 0)
            self._plan_store(tracker, computed, meta)
            if self._report_allocations:
                records.append(self._allocation_record(tracker, 0))

        cached = scheduler_output.scheduled_cached_reqs
        # vLLM 0.34 sends a resumed request among the new ones, with all its blocks, and
        # its cached requests no longer have `resumed_req_ids`; older releases list it here.
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for idx, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            if tracker is None:
                continue
            new_blocks = _groups(cached.new_block_ids[idx], self._num_groups)
            reused.update(b for group in new_blocks for b in group)
            first_new = len(tracker.block_ids[0]) if tracker.block_ids else 0
            if req_id in resumed or not tracker.block_ids:
                tracker.block_ids = new_blocks
                first_new = 0
            else:
                for group, new in zip(tracker.block_ids, new_blocks, strict=True):
                    group.extend(new)
            computed = cached.num_computed_tokens[idx] + scheduled.get(req_id, 0)
            self._plan_store(tracker, computed, meta)
            if self._report_allocations and any(new_blocks):
                records.append(self._allocation_record(tracker, first_new))

        if records:
            self._call(self._client.report_block_allocations, None, records)
        if self._frees_early:
            reused.discard(NULL_BLOCK)
            meta.reused_block_ids = sorted(reused)
        self._prefill.step(sum(scheduled.values()), frozenset(scheduled),
                           bool(meta.loads or meta.staged))
        self._scheduled = set(scheduled)
        # Where synchronous loads are not used (vLLM's asynchronous scheduling, several KV
        # cache groups, or a load planned while other requests ran), an engine with only
        # loads to wait for would otherwise spin empty steps (vLLM sleeps 1 ms after each)
        # until a poll finds the copy done, then take steps more to schedule the request.
        # Waiting in this step delays only a request that arrives meanwhile, as a
        # synchronous load would; a failure is still reported as an asynchronous load's,
        # which vLLM recomputes under either scheduling.
        meta.wait_for_loads = (self._wait_idle_loads and self._load_time.pending
                               and not any(scheduled.values()))
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for request_id in getattr(output, "finished_recving", None) or ():
            self._load_time.received(request_id)
        invalid = output.invalid_block_ids
        # With several KV cache groups failed loads come by request instead.
        failed = getattr(output, "failed_recving", None) or ()
        if not (invalid or failed):
            return
        for tracker in self._trackers.values():
            if tracker.load_block_ids and (tracker.request_id in failed or (
                    invalid and not tracker.load_block_ids.isdisjoint(invalid))):
                # The retrieve failed and vLLM recomputes those tokens: store
                # them again, the server may have lost them.
                tracker.stored_end = min(tracker.stored_end, tracker.load_start)
                if (offered := self._offered_for(tracker)) is not None:
                    # Its chunks, and the tail it read (which may end before the prompt's).
                    offered.discard(self._piece_names(
                        tracker, tracker.load_start, len(tracker.token_ids),
                        tracker.tail_end))
                tracker.load_block_ids = frozenset()

    def request_finished(self, request: Request) -> bool:
        """Forget the request; True when its blocks must wait for its stores."""
        self._prefill.finished(request.request_id, _completed(request))
        tracker = self._trackers.pop(request.request_id, None)
        self._load_time.forget(request.request_id)
        self._scheduled.discard(request.request_id)
        if tracker is None:
            return False
        self._release_staged(tracker)
        if tracker.phase is Phase.LOOKUP and tracker.lookup_tokens:
            # Aborted before vLLM allocated blocks: nothing will be retrieved,
            # so release every chunk the lookup may have locked.
            end = tracker.external_hit if tracker.external_hit is not None else (
                tracker.lookup_tokens
            )
            self._free_locks(tracker, 0, end)
        if tracker.lookup_tokens:
            self._call(self._client.cleanup_lookup_result, None, tracker.request_id)
        if tracker.talked_to_server:
            self._call(self._client.end_session, None, tracker.request_id)
        if tracker.has_stores:
            self._delayed_free.append(tracker.request_id)
        return tracker.has_stores

    def shutdown(self) -> None:
        # Stops the client's heartbeat thread and closes its socket.
        self._call(self._client.shutdown, None)

    # ---- helpers ---------------------------------------------------------

    def _lookup_len(self, tracker: RequestTracker) -> int:
        if self._store_generated:
            return len(tracker.token_ids)
        return tracker.prompt_len

    def _load_end(self, tracker: RequestTracker, hit: int) -> int:
        """Where a load of a `hit`-token prefix ends: all of it, but never the request's
        last token, which vLLM computes to sample the next one."""
        return max(0, min(hit, len(tracker.token_ids) - 1))

    def _submit_lookup(self, tracker: RequestTracker, num_tokens: int) -> bool:
        # The client cuts the whole chunks itself.
        tokens = list(tracker.token_ids[:num_tokens])
        rate = self._prefill.tokens_per_s if self._skip_slow_loads else None
        submit = self._client.maybe_submit_lookup_request
        if self._block_events is not None and self._hashed_per_block(tracker):
            # What the server holds in CPU memory is never brought up: no hashes needed.
            held = self._block_events.held_prefix(tracker.block_hashes, self._block_size)
            submit = functools.partial(submit, block_hashes=tracker.block_hashes,
                                       held_blocks=held)
        if self._tails:
            submit = functools.partial(submit, tails=True)
        if self._state_groups:
            submit = functools.partial(submit, states=True)
        ok = self._call(submit, False, tracker.request_id, tokens, tracker.cache_salt, rate)
        if ok is False:
            return False
        tracker.lookup_tokens = num_tokens
        tracker.talked_to_server = True
        return True

    def _plan_store(
        self, tracker: RequestTracker, computed: int, meta: KVDepotConnectorMetadata
    ) -> None:
        if not (self._can_store and tracker.cacheable and tracker.block_ids):
            return
        # Only tokens whose KV this step computes and whose ids are known
        # (speculative and not-yet-sampled positions are excluded).
        limit = len(tracker.token_ids) if self._store_generated else tracker.prompt_len
        allocated = min(len(group) for group in tracker.block_ids) * self._block_size
        end = min(computed, limit, len(tracker.token_ids), allocated)
        end -= end % self._chunk
        tail_end = self._tail_end(tracker, computed, allocated, end)
        if end <= tracker.stored_end and not tail_end:
            return
        # A chunk is stored with every group's blocks or not at all: chunks where a
        # sliding window has already let blocks go are skipped.
        start = self._first_whole_chunk(tracker, tracker.stored_end, end)
        tracker.stored_end = max(tracker.stored_end, end)
        if start > end:
            tail_end = 0  # the tail follows chunks this store does not reach
        if tail_end:
            tracker.tail_end = tail_end
        start, tail_end = self._not_offered(tracker, start, end, tail_end)
        if start >= end and not tail_end:
            return
        # With state groups, one store per state vLLM holds at a chunk end (each ends its
        # range), and one for the chunks after the last of them.
        pieces, first = [], start
        for state_end in self._state_ends(tracker, start, end) if self._state_groups else ():
            pieces.append((first, state_end, True))
            first = state_end
        if first < end or not pieces:
            pieces.append((first, end, False))
        for first, last, with_state in pieces:
            spec = self._spec(tracker, first, tail_end or last,
                              tail=tail_end - last if tail_end else 0, with_state=with_state)
            if self._block_events is not None:
                # Whole chunks only: the server reports no tails.
                spec.block_hashes, spec.hash_block_size = self._hashes(tracker, first, last)
            meta.stores.append(spec)
        if (offered := self._offered_for(tracker)) is not None:
            offered.add(self._piece_names(tracker, start, end, tail_end))
        tracker.has_stores = True
        tracker.talked_to_server = True

    def _not_offered(self, tracker: RequestTracker, start: int, end: int, tail_end: int
                     ) -> tuple[int, int]:
        """A store of chunks [start, end) and a tail ending at `tail_end` (0: none) less
        the leading chunks, and the tail, that this engine's stores or lookups already
        named to the server (`offered_chunks`): those of a prompt vLLM served from its own
        prefix cache, above all."""
        offered = self._offered_for(tracker)
        if offered is None:
            return start, tail_end
        while start < end and self._piece_name(tracker, start + self._chunk) in offered:
            start += self._chunk
        if tail_end and self._piece_name(tracker, tail_end) in offered:
            tail_end = 0
        return start, tail_end

    def _learn_held(self, tracker: RequestTracker, held: int, asked: int) -> None:
        """Record a lookup's answer: the server holds tokens [0, held) of the `asked`, and
        none of the whole chunks after them, nor the asked prompt's own tail if the
        answer stops short of it."""
        offered = self._offered_for(tracker)
        if offered is None:
            return
        whole = held - held % self._chunk
        offered.add(self._piece_names(tracker, 0, whole, held if held > whole else 0))
        missing = asked - asked % self._chunk
        offered.discard(self._piece_names(tracker, whole, missing,
                                          asked if held < asked else 0))

    def _offered_for(self, tracker: RequestTracker) -> OfferedChunks | None:
        """The record of pieces named to the server now running, where `tracker`'s pieces
        have names (vLLM hashed it one hash per block of ours); else None."""
        if self._offered is None or not self._hashed_per_block(tracker):
            return None
        return self._offered.of_server(self._client.boot_id)

    def _piece_names(self, tracker: RequestTracker, start: int, end: int, tail_end: int
                     ) -> list[Hashable]:
        """The names of the whole chunks in [start, end) and of the tail ending at
        `tail_end` (0: none)."""
        names = [self._piece_name(tracker, e)
                 for e in range(start + self._chunk, end + 1, self._chunk)]
        if tail_end % self._chunk:
            names.append(self._piece_name(tracker, tail_end))
        return names

    def _piece_name(self, tracker: RequestTracker, end: int) -> Hashable:
        """What names the piece of `tracker`'s tokens ending at `end` (a whole chunk at a
        chunk boundary, else a tail): vLLM's hash of the block it ends in, which chains
        every token before and the key scope; a tail adds the tokens past its last
        whole block (hashed: a name must stay small, and two tails sharing one is only
        a store skipped)."""
        bs = self._block_size
        full = end // bs
        anchor = tracker.block_hashes[full - 1] if full else tracker.cache_salt
        if end % self._chunk == 0:
            return anchor
        return ("tail", anchor, hash(tuple(tracker.token_ids[full * bs:end])))

    def _state_ends(self, tracker: RequestTracker, start: int, end: int) -> list[int]:
        """The chunk ends in (start, end] after which vLLM holds a recurrent state in
        every state group. In "align" mode the block for the state after token e
        (`_state_block`) is vLLM's null block unless a step ended at e or vLLM cached
        the state there; it is read in the step that computes e (or, from vLLM's own
        prefix cache, while the request holds it), before a later step may let it go."""
        cs = self._chunk
        return [e for e in range(start + cs, end + 1, cs)
                if all(self._state_block(tracker.block_ids[g], e) != NULL_BLOCK
                       for g in self._state_groups)]

    def _state_block(self, group: list[int], end: int) -> int:
        """The block of a state group's list holding the state after token `end` (a block
        boundary): the block whose last token is `end - 1`."""
        index = end // self._block_size - 1
        return group[index] if 0 <= index < len(group) else NULL_BLOCK

    def _tail_end(self, tracker: RequestTracker, computed: int, allocated: int,
                  whole_end: int) -> int:
        """Where the prompt's tail ends, if this step's store should carry it: once the
        whole prompt is computed, its tokens past its last whole chunk (at least
        `MIN_TAIL_TOKENS`), right after the whole chunks stored up to `whole_end`, and
        not stored (or loaded) before. 0 otherwise."""
        if not self._tails or computed < tracker.prompt_len:
            return 0
        end = min(tracker.prompt_len, len(tracker.token_ids), allocated)
        if end % self._chunk < MIN_TAIL_TOKENS or end - end % self._chunk != whole_end:
            return 0
        return end if end > tracker.tail_end else 0

    def _first_whole_chunk(self, tracker: RequestTracker, start: int, end: int) -> int:
        """The first chunk boundary in [start, end) from which every group holds every
        block (vLLM's null blocks only lead a sliding-window group's list)."""
        bs = self._block_size
        first = start
        # Full attention only: vLLM frees none of the request's blocks early. A state
        # group's null blocks are states vLLM does not hold, which chunks never carry.
        for number, group in enumerate(tracker.block_ids if self._frees_early else ()):
            if number in self._state_groups:
                continue
            ids = group[start // bs : end // bs]
            if NULL_BLOCK in ids:
                last_null = start + (len(ids) - ids[::-1].index(NULL_BLOCK)) * bs
                first = max(first, -(-last_null // self._chunk) * self._chunk)
        return first

    def _spec(self, tracker: RequestTracker, start: int, end: int, skip: int = 0,
              tail: int = 0, with_state: bool = False) -> TransferSpec:
        """A transfer of [start, end), ending in a tail of `tail` tokens if not 0. With
        state groups each one's list is the block of the state after `end` when
        `with_state`, else empty."""
        bs = self._block_size
        # A load may end inside a chunk or tail: its key needs its every token, and
        # only the blocks holding tokens before `end` are named.
        cs = self._chunk
        token_end = (max(end - 1, start) // cs * cs + tail) if tail else -(-end // cs) * cs
        states = self._state_groups
        return TransferSpec(
            request_id=tracker.request_id,
            token_ids=list(tracker.token_ids[:token_end]),
            block_ids=[([self._state_block(group, end)] if with_state else [])
                       if number in states else group[start // bs : -(-end // bs)]
                       for number, group in enumerate(tracker.block_ids)],
            start=start,
            end=end,
            cache_salt=tracker.cache_salt,
            skip_first_n_tokens=skip,
            tail_tokens=tail,
            state_groups=states if with_state else (),
        )

    def _hashes(self, tracker: RequestTracker, start: int, end: int) -> tuple[bytes, int]:
        """vLLM's hashes of the blocks of [start, end), concatenated, and the tokens per
        block; none where vLLM has not hashed them all (or with hashes of mixed sizes)."""
        bs = self._block_size
        hashes = tracker.block_hashes[start // bs:end // bs]
        if (not self._hashed_per_block(tracker) or len(hashes) != (end - start) // bs
                or len({len(h) for h in hashes}) != 1):
            return b"", 0
        return b"".join(hashes), bs

    def _hashed_per_block(self, tracker: RequestTracker) -> bool:
        """vLLM hashed the request one hash per block of ours (a hybrid model may hash
        finer): only then do its hashes name our blocks."""
        return len(tracker.block_hashes) == len(tracker.token_ids) // self._block_size

    def take_events(self) -> list[KVCacheEvent]:
        """vLLM's KV events for what kvdepot stored and dropped since the last call."""
        if self._block_events is None:
            return []
        try:
            return vllm_events(self._block_events.take())
        except Exception as exc:  # a broken cache server must only cost events
            _bad_input_log.warning("take-events", "kvdepot: block events failed: %r", exc)
            return []

    def _expected_blocks(self, tracker: RequestTracker, end: int) -> list[int]:
        """The blocks vLLM expects a load to fill with tokens [local_hit, end): every
        group's, none it shares with its own prefix cache (vLLM's hit is whole blocks) and
        none a sliding window let go. Reported failed, they are what vLLM recomputes
        instead of reading memory nothing wrote."""
        bs = self._block_size
        return held_blocks(_held([group[tracker.local_hit // bs : -(-end // bs)]
                                  for group in tracker.block_ids]))

    def _allocation_record(self, tracker: RequestTracker, first_block: int
                           ) -> BlockAllocationRecord:
        bs = self._block_size
        # Telemetry: one attention group's blocks (every group spans the same tokens).
        group = tracker.block_ids[self._telemetry_group]
        new_blocks = group[first_block:]
        tokens = tracker.token_ids[first_block * bs : len(group) * bs]
        return BlockAllocationRecord(
            req_id=tracker.request_id, new_block_ids=list(new_blocks), new_token_ids=list(tokens)
        )

    def _free_locks(self, tracker: RequestTracker, start: int, end: int) -> None:
        if end > start:
            self._call(self._client.release_locks, None, tracker.request_id, start, end)

    def _call(self, fn: Callable[..., T], default: T, *args: Any) -> T:
        # The client already degrades on its own when the server goes away;
        # this is the last line that keeps an unexpected client error from
        # killing vLLM's engine loop.
        try:
            return fn(*args)
        except Exception:
            log.warning("kvdepot: %s failed; continuing without the cache",
                           getattr(fn, "__name__", fn), exc_info=True)
            return default
