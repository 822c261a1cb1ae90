"""`kvdepot serve`: build the server from its options and run it until a signal.

SIGTERM or SIGINT drains the server (`Depot.begin_drain`: in-flight transfers finish,
nothing new starts, for at most --drain-timeout seconds), then writes behind what is
queued for the lower tiers and exits with status 0; a second signal stops it at once.
"""

from __future__ import annotations

import logging
import resource
import signal
import socket
import threading
from pathlib import Path

import torch
import zmq

from kvdepot.metrics import MetricsRegistry
from kvdepot.native import HASHES_IN_C, NATIVE_HASH_VARIABLE
from kvdepot.options import Options
from kvdepot.rpc.auth import (
    CredentialStore,
    ServerAuth,
    server_keypair,
    write_owner_credential,
)
from kvdepot.rpc.credentials import (
    CURVE,
    NULL,
    default_state_dir,
    ensure_private_dir,
)
from kvdepot.rpc.router import FINAL_REPLIES_LINGER_MS, RouterServer
from kvdepot.server.admin_api import AdminServer, AdminState
from kvdepot.server.assembly import assemble_server, shared_tier
from kvdepot.server.http_bounds import HttpBounds
from kvdepot.server.prometheus import MetricsServer
from kvdepot.server.readiness import EngineReadiness
from kvdepot.server.socket_dir import REQUEST_SOCKET, SocketDir
from kvdepot.sizes import format_size
from kvdepot.storage.tier import LowerTier

log = logging.getLogger("kvdepot.server")


class RunningServer:
    """A server bound and ready; `run()` blocks until `stop()` or a signal."""

    def __init__(self, options: Options) -> None:
        if options.chunk_size <= 0:
            raise ValueError(f"--chunk-size must be positive, got {options.chunk_size}")
        if not 0 < options.max_locked_share <= 1:
            raise ValueError("--max-locked-share must be in (0, 1], got "
                             f"{options.max_locked_share}")
        # Every computed default (CPU tier, threads, disk size, registration bounds) is
        # resolved here, once; everything below reads the result.
        options = options.resolved(copy_processes=torch.cuda.is_available())
        self.options = options
        self.descriptor_limit = raise_descriptor_limit()  # before anything is opened
        metrics = MetricsRegistry()
        # First: a bad --shared-tier is refused before anything is bound.
        shared = shared_tier(options, metrics) if options.shared_tier_url else None
        self.auth = set_up_auth(options)
        # The admin API comes up first, so probes see the server start (503 from /readyz
        # while the pool is allocated, which takes seconds for a large page-locked one).
        # One set of HTTP bounds for the admin API and the metrics listener together.
        self.http_bounds = HttpBounds(self.descriptor_limit, metrics)
        self.admin_state = AdminState(options, self.auth, bounds=self.http_bounds,
                                      readiness=EngineReadiness(options.url,
                                                                self.descriptor_limit))
        self.admin = AdminServer(self.admin_state) if options.admin_port else None
        try:
            self._build(options, metrics, shared)
        except BaseException:
            if self.admin is not None:
                self.admin.stop()
            raise
        self.admin_state.router, self.admin_state.depot = self.router, self.depot

    def _build(self, options: Options, metrics: MetricsRegistry, shared: LowerTier | None
               ) -> None:
        """The router, then everything `assemble_server` builds."""
        # Checked before anything listens: a directory others may write is refused.
        socket_dir = SocketDir(options.socket_dir) if options.socket_dir else None
        self.router = RouterServer(options.url, auth=self.auth)
        if socket_dir is not None:
            socket_dir.claim(REQUEST_SOCKET, socket.SOCK_STREAM)
            self.router.listen_also(socket_dir.request_url)
            socket_dir.make_connectable(REQUEST_SOCKET)
        assembled = assemble_server(options, metrics, self.auth, shared, socket_dir)
        self.depot, self.memory, self.events = assembled
        self.depot.on_drained = self.router.stop

    def begin_drain(self) -> None:
        """The first signal drains (see the module), a second one stops at once."""
        if self.depot.draining:
            self.stop()
        else:
            self.depot.begin_drain()

    def stop(self) -> None:
        self.router.stop()

    def run(self) -> None:
        metrics_server = None
        if self.options.metrics_port:
            metrics_server = MetricsServer(self.options.metrics_host, self.options.metrics_port,
                                           self.depot.metrics.snapshot, self.http_bounds,
                                           self.depot.engines.describe)
            log.info("Prometheus metrics on http://%s:%d/metrics", self.options.metrics_host,
                     self.options.metrics_port)
        if self.admin is not None:
            log.info("admin API and dashboard on %s/ (docs/admin.md)", self.admin.url)
        if not HASHES_IN_C:
            log.info("key chains are hashed with the blake3 package, not kvdepot.native "
                     "(%s=0, or the extension is not built)", NATIVE_HASH_VARIABLE)
        log.info("kvdepot listening on %s: chunk size %d tokens, %s of %s",
                 self.options.url, self.options.chunk_size,
                 format_size(self.depot.tier.capacity), self.memory)
        if self.events is not None:
            log.info("KV events on %s (replay on %s)", self.events.url, self.events.replay_url)
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
            if self.admin is not None:
                self.admin.stop()
            if metrics_server is not None:
                metrics_server.stop()
            self.depot.close()
            self.router.close()
            log.info("kvdepot stopped")


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit and return it.

    The inherited soft limit is usually 1,024: every connection (authenticated or not,
    until its handshake times out), every registration's memory files and every parked
    handover descriptor counts against it, and another user's 1,100 raw connections
    once took them all. The hard limit is what the operator allows this process; the
    per-peer and handover bounds (`kvdepot.rpc.connection_guard`,
    `kvdepot.server.handover`) are shares of the figure returned here."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as exc:  # a hard limit above the kernel's nr_open
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard,
                        exc)
            return soft
        log.info("open-file limit raised from %d to %d (the hard limit)", soft, hard)
        return hard
    log.info("open-file limit: %s", "unlimited" if soft == resource.RLIM_INFINITY else soft)
    return soft


def set_up_auth(options: Options) -> ServerAuth:
    """The state directory, the owner credential for this URL, and the mechanism: CURVE
    on every address, loopback and ipc:// included (it is the only mechanism that proves
    the server's identity to a client, so a process that took the port of a stopped
    server gets nothing); none with --insecure. Where libzmq lacks CURVE the server
    refuses to start without --insecure."""
    state_dir = ensure_private_dir(Path(options.state_dir) if options.state_dir
                                   else default_state_dir())
    if options.insecure:
        mechanism = NULL
    elif zmq.has("curve"):
        mechanism = CURVE
    else:
        raise ValueError("refusing to start: this libzmq lacks CURVE, which kvdepot needs to "
                         "prove the server's identity to its clients (on loopback too); "
                         "install pyzmq with libsodium (the pyzmq wheels have it), or run "
                         "--insecure to serve everyone who can reach the port")
    public, secret = server_keypair(state_dir) if mechanism == CURVE else ("", "")
    owner = write_owner_credential(state_dir, options.url, mechanism, public)
    if mechanism == NULL:
        return ServerAuth(NULL, None)
    return ServerAuth(mechanism, CredentialStore(state_dir, owner), secret)


def serve(options: Options) -> None:
    server = RunningServer(options)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: server.begin_drain())
    server.run()
    _send_final_replies()


def _send_final_replies() -> None:
    """Let ZeroMQ's I/O threads send what is still queued (`FINAL_REPLIES_LINGER_MS`)
    before the process exits, which would end them mid-send. Ending the context waits for
    that; on a thread of its own, so a socket some component left open cannot hold the
    exit past the linger."""
    ender = threading.Thread(target=zmq.Context.instance().term, name="zmq-term", daemon=True)
    ender.start()
    ender.join(FINAL_REPLIES_LINGER_MS / 1000 + 1)
