"""`kvdepot serve`: build the server from its options and run it until a signal."""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass

from kvdepot.protocol import Empty, RequestType
from kvdepot.rpc.router import RouterServer
from kvdepot.server.defaults import DEFAULT_TRANSFER_THREADS
from kvdepot.server.depot import Depot, DepotConfig
from kvdepot.sizes import format_size
from kvdepot.storage.cpu_tier import CPUTier
from kvdepot.storage.disk_tier import DiskTier
from kvdepot.storage.host_pool import allocate_pool

log = logging.getLogger("kvdepot.server")


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 5555
    chunk_size: int = 256
    l1_bytes: int = 1 << 30
    lock_ttl: float = 300.0
    transfer_threads: int = DEFAULT_TRANSFER_THREADS
    pin_memory: bool | None = None
    metrics_port: int | None = None
    disk_path: str | None = None
    disk_bytes: int = 0

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"


class RunningServer:
    """A server bound and ready; `run()` blocks until `stop()` or a signal."""

    def __init__(self, options: ServeOptions) -> None:
        if options.chunk_size <= 0:
            raise ValueError(f"--chunk-size must be positive, got {options.chunk_size}")
        self.options = options
        self.router = RouterServer(options.url)
        pool = allocate_pool(options.l1_bytes, options.pin_memory)
        self.depot = Depot(
            DepotConfig(options.chunk_size, options.lock_ttl, options.transfer_threads),
            CPUTier(pool),
            [DiskTier(options.disk_path, options.disk_bytes)] if options.disk_path else [],
        )

    def stop(self) -> None:
        self.router.stop()

    def run(self) -> None:
        if self.options.metrics_port:
            from kvdepot.server.metrics import serve_metrics

            serve_metrics(self.options.host, self.options.metrics_port,
                          lambda: self.depot.handle(RequestType.STATS, Empty()).values)
            log.info("Prometheus metrics on http://%s:%d/metrics", self.options.host,
                     self.options.metrics_port)
        pinned = " page-locked" if self.depot.tier.pool.is_pinned() else ""
        log.info("kvdepot listening on %s: chunk size %d tokens, %s of%s CPU memory",
                 self.options.url, self.options.chunk_size,
                 format_size(self.depot.tier.capacity), pinned)
        try:
            self.router.run(self.depot)
        finally:
            self.depot.close()
            log.info("kvdepot stopped")


def serve(options: ServeOptions) -> None:
    server = RunningServer(options)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: server.stop())
    server.run()
