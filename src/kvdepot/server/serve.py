"""`kvdepot serve`: build the server from its options and run it until a signal."""

from __future__ import annotations

import logging
import signal
import threading

from kvdepot.metrics import MetricsRegistry
from kvdepot.options import Options, default_l1_bytes
from kvdepot.protocol import Empty, RequestType
from kvdepot.rpc.router import RouterServer
from kvdepot.server.depot import Depot
from kvdepot.sizes import format_size
from kvdepot.storage.cpu_tier import CPUTier
from kvdepot.storage.disk_tier import DiskTier
from kvdepot.storage.host_pool import allocate_pool

log = logging.getLogger("kvdepot.server")


class RunningServer:
    """A server bound and ready; `run()` blocks until `stop()` or a signal."""

    def __init__(self, options: Options) -> None:
        if options.chunk_size <= 0:
            raise ValueError(f"--chunk-size must be positive, got {options.chunk_size}")
        if not 0 < options.max_locked_share <= 1:
            raise ValueError("--max-locked-share must be in (0, 1], got "
                             f"{options.max_locked_share}")
        self.options = options
        self.router = RouterServer(options.url)
        pool = allocate_pool(options.l1_bytes or default_l1_bytes(), options.pin_memory)
        metrics = MetricsRegistry()
        self.depot = Depot(
            options,
            CPUTier(pool, evictions=metrics.counter("evictions")),
            metrics,
            [DiskTier(options.disk_path, options.disk_bytes,
                      discarded=metrics.counter("lower_tier_discarded_chunks"))]
            if options.disk_path else [],
        )

    def stop(self) -> None:
        self.router.stop()

    def run(self) -> None:
        if self.options.metrics_port:
            from kvdepot.server.prometheus import serve_metrics

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


def serve(options: Options) -> None:
    server = RunningServer(options)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: server.stop())
    server.run()
