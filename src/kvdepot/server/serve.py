"""`kvdepot serve`: build the server from its options and run it until a signal."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import zmq

from kvdepot.metrics import MetricsRegistry
from kvdepot.native import HASHES_IN_C, NATIVE_HASH_VARIABLE
from kvdepot.options import Options, default_l1_bytes
from kvdepot.rpc.auth import (
    CredentialStore,
    ServerAuth,
    server_keypair,
    write_owner_credential,
)
from kvdepot.rpc.credentials import (
    CURVE,
    NULL,
    PLAIN,
    default_state_dir,
    ensure_private_dir,
    is_loopback_host,
)
from kvdepot.rpc.router import RouterServer
from kvdepot.server.depot import Depot
from kvdepot.server.handover import HandoverListener
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
        self.auth = set_up_auth(options)
        self.router = RouterServer(options.url, auth=self.auth)
        pool = allocate_pool(options.l1_bytes or default_l1_bytes(), options.pin_memory)
        metrics = MetricsRegistry()
        self.depot = Depot(
            options,
            CPUTier(pool, evictions=metrics.counter("evictions")),
            metrics,
            [DiskTier(options.disk_path, options.disk_bytes,
                      discarded=metrics.counter("lower_tier_discarded_chunks"))]
            if options.disk_path else [],
            HandoverListener(self.auth.store),
        )

    def stop(self) -> None:
        self.router.stop()

    def run(self) -> None:
        if self.options.metrics_port:
            from kvdepot.server.prometheus import serve_metrics

            serve_metrics(self.options.metrics_host, self.options.metrics_port,
                          self.depot.metrics.snapshot)
            log.info("Prometheus metrics on http://%s:%d/metrics", self.options.metrics_host,
                     self.options.metrics_port)
        if not HASHES_IN_C:
            log.info("key chains are hashed with the blake3 package, not kvdepot.native "
                     "(%s=0, or the extension is not built)", NATIVE_HASH_VARIABLE)
        pinned = " page-locked" if self.depot.tier.pool.is_pinned() else ""
        log.info("kvdepot listening on %s: chunk size %d tokens, %s of%s CPU memory",
                 self.options.url, self.options.chunk_size,
                 format_size(self.depot.tier.capacity), pinned)
        if self.auth.enabled:
            assert self.auth.store is not None
            log.info("authentication: %s; the owner credential (admin) is %s", self.auth.mechanism,
                     self.auth.store.owner_path)
        else:
            log.warning("authentication is OFF (--insecure): anyone who reaches %s can read, "
                        "write and clear the cache", self.options.url)
        try:
            self.router.run(self.depot)
        finally:
            self.depot.close()
            log.info("kvdepot stopped")


def set_up_auth(options: Options) -> ServerAuth:
    """The state directory, the owner credential for this URL, and the mechanism: PLAIN on
    loopback, CURVE beyond it (refused where libzmq lacks CURVE), none with --insecure."""
    state_dir = ensure_private_dir(Path(options.state_dir) if options.state_dir
                                   else default_state_dir())
    if options.insecure:
        mechanism = NULL
    elif is_loopback_host(options.host):
        mechanism = PLAIN
    elif zmq.has("curve"):
        mechanism = CURVE
    else:
        raise ValueError(f"refusing to listen on {options.host} (beyond loopback) without "
                         "CURVE encryption, which this libzmq lacks; use a loopback --host, or "
                         "--insecure to serve everyone who can reach it")
    public, secret = server_keypair(state_dir) if mechanism == CURVE else ("", "")
    owner = write_owner_credential(state_dir, options.url, mechanism, public)
    if mechanism == NULL:
        return ServerAuth(NULL, None)
    return ServerAuth(mechanism, CredentialStore(state_dir, owner), secret)


def serve(options: Options) -> None:
    server = RunningServer(options)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: server.stop())
    server.run()
