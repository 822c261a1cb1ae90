"""Graceful drain: the transfers in flight, and when a server that is shutting down may
stop waiting for them.

The Depot counts every transfer it hands to a thread (`started`) and every one whose
reply has gone (`finished`). After `begin`, the drain is over once none is in flight and
either no retrieve promised by a lookup is owed or no engine has sent anything for
`DRAIN_IDLE` (counted from the latest of the drain's start, the last transfer and the last
request of any engine: an engine still talking to the server may still come for what it
was promised), or at the deadline, whichever comes first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

DRAIN_IDLE = 5.0
"""Seconds without a transfer after which a drain stops waiting for retrieves that
lookups promised: an engine loads in the step after its lookup, and one that has not in
this long (a long step of a busy engine included) recomputes instead."""


class Drain:
    def __init__(self, timeout: float, promised_reads: Callable[[], int]) -> None:
        """`promised_reads`: how many lookups still owe reads (called on the control
        thread, during a drain only)."""
        self.timeout = timeout
        self._promised_reads = promised_reads
        self._deadline: float | None = None
        self._over = False
        self._in_flight = 0
        self._lock = threading.Lock()
        self._last_heard = 0.0

    @property
    def active(self) -> bool:
        return self._deadline is not None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def started(self) -> None:
        with self._lock:
            self._in_flight += 1
        self._last_heard = time.monotonic()

    def heard(self) -> None:
        """A request came (any kind but the admin's), during a drain: engines are alive."""
        self._last_heard = time.monotonic()

    def finished(self) -> None:
        self._last_heard = time.monotonic()
        with self._lock:
            self._in_flight -= 1

    def begin(self) -> None:
        """Start the clock (once; calling again changes nothing)."""
        if self._deadline is None:
            now = time.monotonic()
            self._deadline = now + self.timeout
            self._last_heard = max(self._last_heard, now)
            log.info("draining: no new lookups, stores or registrations; waiting up to %.0f s "
                     "for %d transfers in flight", self.timeout, self._in_flight)

    def is_over(self) -> bool:
        """True once, when the drain has just ended (logged); False before and after."""
        if self._deadline is None or self._over:
            return False
        now = time.monotonic()
        quiet = now - self._last_heard >= DRAIN_IDLE
        done = self._in_flight == 0 and (quiet or not self._promised_reads())
        if not done and now < self._deadline:
            return False
        self._over = True
        if done:
            log.info("drained: no transfer in flight")
        else:
            log.warning("drain timeout: %d transfers still in flight are abandoned",
                        self._in_flight)
        return True
