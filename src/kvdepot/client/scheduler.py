"""The scheduler-side client: prefix lookups, their locks, and session bookkeeping.

Lives in the engine's scheduler loop, so every call is cheap: a lookup waits only for
the server's acknowledgement (the server answers lookups inline, never behind a copy),
and everything else is fire-and-forget. While the server is unhealthy every call is a
no-op and lookups report 0 hits, so the engine simply computes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

from kvdepot.client.depot_client import DepotClient
from kvdepot.client.engine_types import BlockAllocationRecord
from kvdepot.errors import ServerUnavailable
from kvdepot.protocol import (
    MAX_BLOCK_REPORT_BYTES,
    MAX_BLOCK_REPORT_RECORDS,
    MAX_TOKENS,
    BlockAllocation,
    BlockEvents,
    EndSession,
    FreeLookupLocks,
    KeyScope,
    Lookup,
    QueryPrefetchStatus,
    ReportBlockAllocation,
    RequestType,
    TakeBlockEvents,
    pack_ints,
)
from kvdepot.rpc.future import ReplyFuture

log = logging.getLogger(__name__)

_RECORD_OVERHEAD_BYTES = 16
"""A generous bound of what one record adds to a report besides its id and arrays."""


MIN_TAIL_TOKENS = 16
"""The shortest tail (a prompt's tokens past its last whole chunk) worth storing and
looking up: shorter ones save an engine well under a millisecond of compute, yet cost a
copy per store and retrieve, a key, and a block of memory."""


class SchedulerClient(DepotClient):
    def __init__(self, *args, **kwargs) -> None:  # same arguments as DepotClient
        super().__init__(*args, **kwargs)
        self._pending_lookups: set[str] = set()
        self._finished_lookup_results: dict[str, int] = {}
        self._abandoned_lookups: set[str] = set()
        """Lookups that timed out: the server may still run them and lock their chunks,
        so their sessions are ended as soon as it answers again."""
        self._abandoned_mutex = threading.Lock()
        self._hit_unit: dict[str, int] = {}
        """Per lookup sent, tokens per unit of the server's answer: 1 when it asked for
        tails (the answer counts tokens), else the chunk size (it counts chunks)."""

    def _scope(self, cache_salt: str) -> KeyScope:
        return KeyScope(self.model_name, self.world_size, cache_salt)

    def maybe_submit_lookup_request(self, request_id: str, token_ids: list[int],
                                    cache_salt: str = "",
                                    prefill_tokens_per_s: float | None = None,
                                    block_hashes: Sequence[bytes] = (),
                                    held_blocks: int = 0, tails: bool = False,
                                    states: bool = False) -> None:
        """Ask which leading chunks of `token_ids` the server holds, and lock them.

        Does nothing if a lookup for `request_id` is pending or the server is unhealthy.
        `prefill_tokens_per_s`: the engine's measured prefill rate; with it the server
        reads from its disk and shared tiers only what loads faster than it computes.
        `block_hashes`: vLLM's hashes of the prompt's blocks (`vllm_block_size` tokens
        each), under which the server reports chunks it brings up for this lookup; those
        of the whole chunks within the first `held_blocks` blocks (known to be in the
        server's CPU memory, so never brought up) are not sent. `tails`: the hit may end in
        a tail, tokens past its last whole chunk (`check_lookup_result` then need not be
        a multiple of the chunk size). `states`: the engine has recurrent layers, so the
        hit ends at the last chunk whose end state the server holds (`Lookup.states`).
        """
        self._ensure_heartbeat_started()
        if not self.is_healthy or request_id in self._pending_lookups:
            return
        self._end_abandoned_lookups()
        # Without tails the server looks at whole chunks only: a prompt shorter than one
        # chunk need not travel at all (nor one shorter than a tail with them).
        short = len(token_ids) < (MIN_TAIL_TOKENS if tails else self.chunk_size)
        if len(token_ids) > MAX_TOKENS:
            token_ids = token_ids[:MAX_TOKENS]  # a prefix: its hit is a prefix of the hit
        # Exactly the hashes of the whole chunks looked up past those held, or none.
        per_chunk = self.chunk_size // self.block_size
        chunks = len(token_ids) // self.chunk_size
        first = min(held_blocks // per_chunk, chunks)
        hashes = block_hashes[first * per_chunk:chunks * per_chunk]
        sent = (b"".join(hashes) if hashes and len(hashes) == (chunks - first) * per_chunk
                and len({len(h) for h in hashes}) == 1 else b"")
        request = Lookup(request_id=request_id, scope=self._scope(cache_salt),
                         token_ids=pack_ints(() if short else token_ids),
                         readers_per_key=self.parallel_strategy.readers_per_key,
                         prefill_tokens_per_s=prefill_tokens_per_s, block_hashes=sent,
                         hash_block_size=self.block_size if sent else 0,
                         hashes_first_chunk=first if sent else 0,
                         hashes_parent=(block_hashes[first * per_chunk - 1]
                                        if sent and first else b""),
                         tails=tails, states=states)
        self._hit_unit[request_id] = 1 if tails else self.chunk_size
        try:
            hit = self._request(RequestType.LOOKUP, request)
        except TimeoutError:
            self._hit_unit.pop(request_id, None)
            with self._abandoned_mutex:
                self._abandoned_lookups.add(request_id)
            return
        except ServerUnavailable:
            self._hit_unit.pop(request_id, None)
            return
        self._pending_lookups.add(request_id)
        if hit is not None:  # known at once: no QUERY_PREFETCH_STATUS round trip needed
            self._finished_lookup_results[request_id] = hit * self._hit_unit[request_id]

    def check_lookup_result(self, request_id: str) -> int | None:
        """Matched tokens (a multiple of the chunk size, unless the lookup asked for
        tails), None while the server is still reading lower tiers. Repeated calls return
        the same answer until cleanup."""
        if request_id not in self._pending_lookups:
            return self._finished_lookup_results.get(request_id, 0)
        if request_id in self._finished_lookup_results:
            return self._finished_lookup_results[request_id]
        if not self.is_healthy:
            return 0
        try:
            hit = self._request(RequestType.QUERY_PREFETCH_STATUS,
                                QueryPrefetchStatus(request_id))
        except (TimeoutError, ServerUnavailable):
            return 0
        if hit is None:
            return None
        tokens = hit * self._hit_unit.get(request_id, self.chunk_size)
        self._finished_lookup_results[request_id] = tokens
        return tokens

    def _on_server_back(self, boot_id: str) -> bool:
        self._boot_id = boot_id
        self._end_abandoned_lookups()
        return True

    @property
    def boot_id(self) -> str:
        """The server process last seen (a new one after a restart)."""
        return self._boot_id

    def submit_take_block_events(self, after: int) -> ReplyFuture[BlockEvents]:
        """TAKE_BLOCK_EVENTS without waiting (`client/block_event_poller.py` polls with it)."""
        return self.mq_client.submit(RequestType.TAKE_BLOCK_EVENTS, TakeBlockEvents(after))

    def _end_abandoned_lookups(self) -> None:
        """End the sessions of lookups this client gave up on. Sent on the connection the
        lookups went out on, so the server reads them after those lookups (and before
        any later lookup under the same id)."""
        if not self._abandoned_lookups:
            return
        with self._abandoned_mutex:
            abandoned, self._abandoned_lookups = self._abandoned_lookups, set()
        unsent = list(abandoned)
        try:
            while unsent:
                self.mq_client.notify(RequestType.END_SESSION, EndSession(unsent[-1]))
                unsent.pop()
        except ServerUnavailable:
            with self._abandoned_mutex:  # tried again when the server answers again
                self._abandoned_lookups.update(unsent)

    def cleanup_lookup_result(self, request_id: str) -> None:
        self._pending_lookups.discard(request_id)
        self._finished_lookup_results.pop(request_id, None)
        self._hit_unit.pop(request_id, None)

    def release_locks(self, request_id: str, start: int, end: int) -> None:
        """Release the lookup's locks of chunks [start // chunk_size, end // chunk_size):
        the chunk holding `start` is freed, the one holding an unaligned `end` is kept; a
        tail is freed when it ends at or before `end`."""
        if self.is_healthy:
            self._notify(RequestType.FREE_LOOKUP_LOCKS, FreeLookupLocks(request_id, start, end))

    def end_session(self, request_id: str) -> None:
        """The request is over: the server forgets it and drops any locks it still holds."""
        if self.is_healthy:
            self._notify(RequestType.END_SESSION, EndSession(request_id))

    def report_block_allocations(self, records: list[BlockAllocationRecord]) -> None:
        """Telemetry, sent in as many reports as the protocol's bounds need; a record that
        alone exceeds a report's bound is dropped (reports may be dropped)."""
        if not self.is_healthy or not records:
            return
        batch: list[BlockAllocation] = []
        budget = MAX_BLOCK_REPORT_BYTES - len(self.model_name.encode()) - 64
        used = 0
        for r in records:
            record = BlockAllocation(r.req_id, pack_ints(list(r.new_block_ids)),
                                     pack_ints(list(r.new_token_ids)))
            size = (len(record.req_id.encode()) + len(record.new_block_ids)
                    + len(record.new_token_ids) + _RECORD_OVERHEAD_BYTES)
            if size > budget:
                log.debug("kvdepot: a block allocation record of %d bytes was not reported", size)
                continue
            if used + size > budget or len(batch) == MAX_BLOCK_REPORT_RECORDS:
                self._send_report(batch)
                batch, used = [], 0
            batch.append(record)
            used += size
        if batch:
            self._send_report(batch)

    def _send_report(self, records: list[BlockAllocation]) -> None:
        self._notify(RequestType.REPORT_BLOCK_ALLOCATION, ReportBlockAllocation(
            engine_pid=os.getpid(), model=self.model_name, records=records))

    def shutdown(self) -> None:
        self.close()
