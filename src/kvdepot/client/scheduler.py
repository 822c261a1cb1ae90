"""The scheduler-side client: prefix lookups, their locks, and session bookkeeping.

Lives in the engine's scheduler loop, so every call is cheap: a lookup waits only for
the server's acknowledgement (the server answers lookups inline, never behind a copy),
and everything else is fire-and-forget. While the server is unhealthy every call is a
no-op and lookups report 0 hits, so the engine simply computes.
"""

from __future__ import annotations

import os

from kvdepot.client.depot_client import DepotClient
from kvdepot.client.engine_types import BlockAllocationRecord
from kvdepot.errors import ServerUnavailable
from kvdepot.protocol import (
    BlockAllocation,
    EndSession,
    FreeLookupLocks,
    KeyScope,
    Lookup,
    QueryPrefetchStatus,
    ReportBlockAllocation,
    RequestType,
    pack_ints,
)


class SchedulerClient(DepotClient):
    def __init__(self, *args, **kwargs) -> None:  # same arguments as DepotClient
        super().__init__(*args, **kwargs)
        self._pending_lookups: set[str] = set()
        self._finished_lookup_results: dict[str, int] = {}

    def _scope(self, cache_salt: str) -> KeyScope:
        return KeyScope(self.model_name, self.world_size, cache_salt)

    def maybe_submit_lookup_request(self, request_id: str, token_ids: list[int],
                                    cache_salt: str = "") -> None:
        """Ask which leading chunks of `token_ids` the server holds, and lock them.

        Does nothing if a lookup for `request_id` is pending or the server is unhealthy.
        """
        self._ensure_heartbeat_started()
        if not self.is_healthy or request_id in self._pending_lookups:
            return
        # The server looks at whole chunks of a strict prefix only; a prompt shorter than
        # one chunk and a token need not travel at all.
        short = len(token_ids) <= self.chunk_size
        request = Lookup(request_id=request_id, scope=self._scope(cache_salt),
                         token_ids=pack_ints(() if short else token_ids),
                         readers_per_key=self.parallel_strategy.readers_per_key)
        try:
            chunks = self._request(RequestType.LOOKUP, request)
        except (TimeoutError, ServerUnavailable):
            return
        self._pending_lookups.add(request_id)
        if chunks is not None:  # known at once: no QUERY_PREFETCH_STATUS round trip needed
            self._finished_lookup_results[request_id] = chunks * self.chunk_size

    def check_lookup_result(self, request_id: str) -> int | None:
        """Matched tokens (a multiple of the chunk size), None while the server is still
        reading lower tiers. Repeated calls return the same answer until cleanup."""
        if request_id not in self._pending_lookups:
            return self._finished_lookup_results.get(request_id, 0)
        if request_id in self._finished_lookup_results:
            return self._finished_lookup_results[request_id]
        if not self.is_healthy:
            return 0
        try:
            chunks = self._request(RequestType.QUERY_PREFETCH_STATUS,
                                   QueryPrefetchStatus(request_id))
        except (TimeoutError, ServerUnavailable):
            return 0
        if chunks is None:
            return None
        tokens = chunks * self.chunk_size
        self._finished_lookup_results[request_id] = tokens
        return tokens

    def cleanup_lookup_result(self, request_id: str) -> None:
        self._pending_lookups.discard(request_id)
        self._finished_lookup_results.pop(request_id, None)

    def free_lookup_locks(self, token_ids: list[int], start: int, end: int, request_id: str,
                          cache_salt: str = "") -> None:
        """Release the locks of chunks [start // chunk_size, end // chunk_size): the chunk
        holding `start` is freed, the one holding an unaligned `end` is kept."""
        if self.is_healthy:
            self._notify(RequestType.FREE_LOOKUP_LOCKS, FreeLookupLocks(request_id, start, end))

    def end_session(self, request_id: str) -> None:
        """The request is over: the server forgets it and drops any locks it still holds."""
        if self.is_healthy:
            self._notify(RequestType.END_SESSION, EndSession(request_id))

    def report_block_allocations(self, records: list[BlockAllocationRecord]) -> None:
        if not self.is_healthy or not records:
            return
        self._notify(RequestType.REPORT_BLOCK_ALLOCATION, ReportBlockAllocation(
            engine_pid=os.getpid(), model=self.model_name,
            records=[BlockAllocation(r.req_id, list(r.new_block_ids), list(r.new_token_ids))
                     for r in records]))

    def shutdown(self) -> None:
        self.close()
