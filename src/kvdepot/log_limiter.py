"""Logging about bad input, at most one line per kind per interval.

Anything a client can trigger at will (malformed frames, oversized fields, requests past
a cap) would otherwise let one client flood the server's log. Each kind of complaint
logs its first occurrence at once, then stays quiet until the interval has passed; the
next line says how many were suppressed meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

DEFAULT_INTERVAL = 10.0
"""Seconds between two lines of the same kind."""


class LogLimiter:
    def __init__(self, logger: logging.Logger, interval: float = DEFAULT_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._mutex = threading.Lock()
        self._next_allowed: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        """Log `message % args` unless a line of `kind` was logged within the interval."""
        now = self._clock()
        with self._mutex:
            if now < self._next_allowed.get(kind, 0.0):
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._next_allowed[kind] = now + self._interval
            suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            message += " (%d more like it were not logged since the last such line)"
            args = (*args, suppressed)
        self._logger.warning(message, *args)
