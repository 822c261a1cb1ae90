"""A circuit breaker for a tier behind the network.

Closed: calls go through. The first failed call opens it: from then on callers skip
the tier at once (lookups answer from local tiers, writes are dropped and counted)
instead of each waiting out its own timeout, and a background thread probes the tier
with a growing pause until a probe succeeds, which closes it again. Each change of
state is logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvdepot.metrics import Counter

log = logging.getLogger(__name__)

FIRST_PROBE_DELAY = 0.1
MAX_PROBE_DELAY = 5.0


class CircuitBreaker:
    def __init__(self, name: str, probe: Callable[[], None], opens: Counter | None = None
                 ) -> None:
        """`probe` raises if the tier is still unreachable; it runs only on the breaker's
        own thread."""
        self.name = name
        self._probe = probe
        self.opens = opens or Counter()
        self._mutex = threading.Lock()
        self._open_since: float | None = None
        self._stopping = threading.Event()
        self._prober: threading.Thread | None = None
        self.last_error = ""

    @property
    def closed(self) -> bool:
        return self._open_since is None

    @property
    def open_seconds(self) -> float:
        since = self._open_since
        return 0.0 if since is None else time.monotonic() - since

    def failed(self, error: BaseException | str) -> None:
        """A call failed: open the breaker (if it is not open already)."""
        with self._mutex:
            self.last_error = str(error) or type(error).__name__
            if self._open_since is not None or self._stopping.is_set():
                return
            self._open_since = time.monotonic()
            self.opens.add()
            self._prober = threading.Thread(target=self._probe_until_closed,
                                            name=f"kvdepot-{self.name}-reconnect", daemon=True)
            self._prober.start()
        log.warning("%s tier unreachable (%s): lookups answer from the local tiers and writes "
                    "to it are dropped until it answers again; reconnecting in the background",
                    self.name, self.last_error)

    def _probe_until_closed(self) -> None:
        delay = FIRST_PROBE_DELAY
        while not self._stopping.wait(delay):
            try:
                self._probe()
            except Exception as exc:
                self.last_error = str(exc) or type(exc).__name__
                delay = min(MAX_PROBE_DELAY, delay * 2)
                continue
            with self._mutex:
                since, self._open_since = self._open_since, None
            log.warning("%s tier reachable again after %.1f s; reading and writing it again",
                        self.name, time.monotonic() - (since or time.monotonic()))
            return

    def close(self) -> None:
        self._stopping.set()
        prober = self._prober
        if prober is not None:
            prober.join(timeout=MAX_PROBE_DELAY + 5)
