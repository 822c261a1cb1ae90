"""Server health: a periodic PING that drives the clients' degraded mode."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvdepot.errors import KVDepotError
from kvdepot.options import DEFAULTS
from kvdepot.protocol import RequestType
from kvdepot.rpc.connection import DepotConnection

log = logging.getLogger(__name__)

RECOVERY_PROBE_INTERVAL = 1.0
"""While unhealthy, probe this often (at most) so service resumes soon after a restart."""


def ping(connection: DepotConnection, timeout: float) -> str | None:
    """The server's boot id, or None if it did not answer in time."""
    try:
        return connection.call(RequestType.PING, timeout=timeout).boot_id
    except (TimeoutError, KVDepotError, ConnectionError):
        return None


class HeartbeatThread(threading.Thread):
    """Sets `health_event` while the server answers, clears it when it does not.

    `on_server_back(boot_id)` runs before the event is set again after an outage, or when
    the boot id shows the server restarted in between; returning False keeps the client
    degraded until the next beat (e.g. a worker whose re-registration failed).
    """

    def __init__(self, mq_client: DepotConnection, health_event: threading.Event,
                 interval: float = DEFAULTS.heartbeat_interval,
                 on_server_back: Callable[[str], bool] | None = None,
                 boot_id: str | None = None) -> None:
        super().__init__(name="kvdepot-heartbeat", daemon=True)
        self._connection = mq_client
        self._health_event = health_event
        self._interval = interval
        self._on_server_back = on_server_back
        self._boot_id = boot_id
        self._stop_event = threading.Event()
        self._wake = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self._wake.set()

    def poke(self) -> None:
        """Beat now (a request just failed: find out quickly whether the server is back)."""
        self._wake.set()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.beat()
            wait = self._interval if self._health_event.is_set() else min(
                self._interval, RECOVERY_PROBE_INTERVAL)
            self._wake.wait(wait)
            self._wake.clear()

    def beat(self) -> bool:
        was_healthy = self._health_event.is_set()
        boot_id = ping(self._connection, timeout=self._interval)
        # Marked unhealthy while the ping was in flight: that mark must not be lost.
        was_healthy = was_healthy and self._health_event.is_set()
        healthy = boot_id is not None
        if healthy and (not was_healthy or boot_id != self._boot_id):
            if self._boot_id is not None and boot_id != self._boot_id:
                log.warning("kvdepot server at %s restarted", self._connection.url)
            if self._on_server_back is not None and not self._on_server_back(boot_id):
                healthy = False
            else:
                self._boot_id = boot_id
        if healthy:
            if not was_healthy:
                log.warning("kvdepot server at %s is healthy again; resuming",
                            self._connection.url)
            self._health_event.set()
        else:
            if was_healthy:
                log.warning("kvdepot server at %s is not answering; degraded mode "
                            "(no lookups, stores or loads) until it is back",
                            self._connection.url)
            self._health_event.clear()
        return healthy
