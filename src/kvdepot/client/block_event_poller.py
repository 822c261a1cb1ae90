"""Polling the server's block events (TAKE_BLOCK_EVENTS) from an engine's scheduler loop.

`take()` never waits: it collects the reply to the previous poll if it has come and sends
the next poll, at most one in flight and one every `interval` seconds. The poller also
remembers which blocks it reported held and where, so that when the server is replaced
(a new process: its CPU memory is gone, and it cannot report removals of what the old one
held) it reports all of them removed; a router then never sends a request to a node for
blocks that are no longer there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvdepot.client.scheduler import SchedulerClient
from kvdepot.errors import KVDepotError
from kvdepot.log_limiter import LogLimiter
from kvdepot.protocol import MAX_BLOCK_EVENTS_REPLY, BlockEvent
from kvdepot.rpc.future import ReplyFuture

log = logging.getLogger(__name__)
_limited = LogLimiter(log)

POLL_INTERVAL = 0.05
"""Seconds between polls: events reach the engine's stream within a step or two."""


class BlockEventPoller:
    def __init__(self, client: SchedulerClient, interval: float = POLL_INTERVAL) -> None:
        self._client = client
        self._interval = interval
        self._after = -1
        self._boot_id = client.boot_id
        self._in_flight: ReplyFuture | None = None
        self._next_poll = 0.0
        self._held: dict[tuple[bytes, int], set[str]] = {}
        """(block hash, block size) -> the media it was reported stored in."""
        self.dropped = 0
        """Events the server dropped before this poller took them."""

    def take(self) -> list[BlockEvent]:
        """The events that have come since the last call (possibly none)."""
        events: list[BlockEvent] = []
        if self._client.boot_id != self._boot_id:
            # Another server process: its places in the log are not the old one's.
            events.extend(self._forget_everything())
            self._boot_id = self._client.boot_id
            self._after = -1
            self._in_flight = None
        future = self._in_flight
        if future is not None and future.done():
            self._in_flight = None
            try:
                reply = future.result(0)
            except (KVDepotError, TimeoutError) as exc:
                _limited.warning("block-events", "kvdepot: block events not taken: %s", exc)
            else:
                self._after = reply.last
                if reply.dropped:
                    self.dropped += reply.dropped
                    _limited.warning("block-events-dropped",
                                     "kvdepot: %d block events were dropped by the server "
                                     "before this engine took them", reply.dropped)
                for event in reply.events:
                    self._remember(event)
                events.extend(reply.events)
                if len(reply.events) == MAX_BLOCK_EVENTS_REPLY:
                    self._next_poll = 0.0  # more are waiting
        now = time.monotonic()
        if self._in_flight is None and now >= self._next_poll and self._client.is_healthy:
            self._next_poll = now + self._interval
            self._in_flight = self._client.submit_take_block_events(self._after)
        return events

    def held_prefix(self, hashes: Sequence[bytes], block_size: int, medium: str = "CPU"
                    ) -> int:
        """How many leading blocks of `hashes` the server reported held in `medium` (and
        not removed since): as of the last events taken, a hint."""
        for n, block in enumerate(hashes):
            if medium not in self._held.get((block, block_size), ()):
                return n
        return len(hashes)

    def _remember(self, event: BlockEvent) -> None:
        for block in event.block_hashes:
            key = (block, event.block_size)
            if event.stored:
                self._held.setdefault(key, set()).add(event.medium)
            elif key in self._held:
                media = self._held[key]
                media.discard(event.medium)
                if not media:
                    del self._held[key]

    def _forget_everything(self) -> list[BlockEvent]:
        removed: dict[tuple[str, int], list[bytes]] = {}
        for (block, block_size), media in self._held.items():
            for medium in media:
                removed.setdefault((medium, block_size), []).append(block)
        self._held.clear()
        return [BlockEvent(False, medium, blocks, None, block_size)
                for (medium, block_size), blocks in removed.items()]
