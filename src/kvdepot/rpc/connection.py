"""The engine side of the transport: one DEALER socket owned by one I/O thread, and a
second one for blocking calls (`call_socket.py`).

Callers on any thread `submit` a request and get a `ReplyFuture`; blocking requests and
their fire-and-forget companions go through `call` and `notify` instead. The socket has
ZMQ_IMMEDIATE set, so nothing is ever queued for a server that is not connected: while
the server is down a submit fails at once, and a request can never be delivered late
to a restarted server. A socket monitor fails every in-flight request the moment the
connection drops, so no caller waits out a timeout for a server that is gone.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import zmq

from kvdepot.errors import AuthenticationFailed, KVDepotError, ServerUnavailable
from kvdepot.options import DEFAULTS
from kvdepot.protocol import (
    ENCODER,
    Empty,
    Message,
    RequestType,
)
from kvdepot.rpc.call_socket import CallSocket
from kvdepot.rpc.credentials import find_credential
from kvdepot.rpc.dealer import (
    ENDS_THE_SESSION,
    RECONNECT_AFTER_REFUSAL,
    check_request_size,
    handshake_failure,
    monitor_events,
    open_dealer,
    reconnect,
    send_request,
)
from kvdepot.rpc.future import ReplyFuture
from kvdepot.rpc.replies import decode_reply, reply_call_id

log = logging.getLogger(__name__)

_EMPTY = ENCODER.encode(Empty())


def probe_server(url: str, timeout: float) -> None:
    """Fail fast, naming the URL, when nothing listens there (ZeroMQ itself would retry forever)."""
    parsed = urlparse(url)
    hint = "is `kvdepot serve` running there?"
    if parsed.scheme == "tcp":
        host = parsed.hostname or "127.0.0.1"
        try:
            with socket.create_connection((host, parsed.port or DEFAULTS.port), timeout=timeout):
                return
        except OSError as exc:
            raise ServerUnavailable(f"no kvdepot server at {url} ({exc.strerror or exc}); "
                                    f"{hint}") from None
    elif parsed.scheme == "ipc":
        path = url[len("ipc://"):]
        if not os.path.exists(path):
            raise ServerUnavailable(f"no kvdepot server at {url} (no socket file); {hint}")
    else:
        raise ValueError(f"unsupported server URL {url!r}: use tcp://host:port or ipc://path")


class DepotConnection:
    """Both DEALERs of one client, presenting the credential `credentials` names (else
    `$KVDEPOT_CREDENTIALS`, else the owner credential a server of this user wrote for
    `url`; see `kvdepot.rpc.credentials`)."""

    def __init__(self, url: str, context: zmq.Context | None = None,
                 connect_timeout: float = DEFAULTS.connect_timeout,
                 credentials: str | None = DEFAULTS.credentials) -> None:
        self.url = url
        probe_server(url, connect_timeout)
        self._credential_path = credentials
        self.credential = find_credential(url, credentials)
        if self.credential is not None:
            # Here, on the caller's thread: an unusable credential is the caller's error,
            # not a traceback in the I/O thread.
            self.credential.check_usable(url)
        self.auth_error: str | None = None
        """Why the I/O socket's last handshake failed, until one succeeds."""
        self._established = False
        self._reconnect_at: float | None = None
        """When the I/O thread connects again after a handshake libzmq gave up on."""
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._outbox: collections.deque[tuple[int, RequestType, bytes, ReplyFuture]] = (
            collections.deque())
        self._pending: dict[int, tuple[RequestType, ReplyFuture]] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._connected = threading.Event()
        self.on_disconnect: list[Callable[[], None]] = []
        """Called on the I/O thread when an established connection drops."""
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvdepot-io", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + connect_timeout
        while not self._connected.wait(0.02) and time.monotonic() < deadline:
            if self.auth_error is not None or not self._thread.is_alive():
                self.close()
                raise AuthenticationFailed(self.auth_error or f"the connection to {url} "
                                           "could not be set up")
        if not self._connected.is_set():
            self.close()
            raise ServerUnavailable(f"kvdepot server at {url} accepted a TCP connection but did "
                                    f"not complete the ZeroMQ handshake within {connect_timeout} s")
        try:
            self._calls = CallSocket(self._ctx, url, connect_timeout, self.credential,
                                     credentials)
        except ServerUnavailable:
            self.close()
            raise

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def submit(self, request_type: RequestType, payload: Message | None = None
               ) -> ReplyFuture:
        """Send a request without waiting; the future settles when its reply arrives."""
        future: ReplyFuture = ReplyFuture()
        if self._closed:
            future.set_exception(ServerUnavailable(f"connection to {self.url} is closed"))
            return future
        body = _EMPTY if payload is None else ENCODER.encode(payload)
        try:  # here, not on the I/O thread, which sends without looking at sizes
            check_request_size(request_type, body)
        except KVDepotError as exc:
            future.set_exception(exc)
            return future
        self._outbox.append((next(self._ids), request_type, body, future))
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # closed concurrently
            future.set_exception(ServerUnavailable(f"connection to {self.url} is closed"))
        return future

    def call(self, request_type: RequestType, payload: Message | None = None, *,
             timeout: float) -> Any:
        """A blocking request made on the calling thread: the reply's value, the server's
        error raised at once, ServerUnavailable or TimeoutError."""
        body = _EMPTY if payload is None else ENCODER.encode(payload)
        return self._calls.call(request_type, body, timeout)

    def notify(self, request_type: RequestType, payload: Message) -> None:
        """Fire-and-forget, in order with this connection's calls; errors are logged.
        Raises ServerUnavailable when the server is not connected."""
        self._calls.notify(request_type, ENCODER.encode(payload))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        calls = getattr(self, "_calls", None)
        if calls is not None:
            calls.close()
        os.write(self._wake_w, b"\0")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- I/O thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            sock, monitor = open_dealer(self._ctx, self.url, self.credential)
        except (KVDepotError, zmq.ZMQError) as exc:  # reported by the constructor
            self.auth_error = f"cannot open a connection to {self.url}: {exc}"
            return
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._closed:
                ready = dict(poller.poll(1000 if self._reconnect_at is None else 100))
                if monitor in ready:
                    self._on_monitor(monitor)
                if self._reconnect_at is not None and time.monotonic() >= self._reconnect_at:
                    self._reconnect_at = None
                    reconnect(sock, self.url)
                if sock in ready:
                    self._receive(sock)
                if self._wake_r in ready or self._outbox:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 65536)
                    self._send(sock)
        finally:
            self._fail_all(ServerUnavailable(f"connection to {self.url} closed"))
            for request in self._outbox:
                request[3].set_exception(ServerUnavailable(f"connection to {self.url} closed"))
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _send(self, sock: zmq.Socket) -> None:
        while self._outbox:
            call_id, request_type, body, future = self._outbox.popleft()
            try:
                send_request(sock, call_id, request_type, body)
            except zmq.Again:
                why = f" ({self.auth_error})" if self.auth_error else ""
                future.set_exception(ServerUnavailable(
                    f"kvdepot server at {self.url} is not connected{why}"))
                continue
            self._pending[call_id] = (request_type, future)

    def _receive(self, sock: zmq.Socket) -> None:
        while True:
            try:
                header, payload = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            entry = self._pending.pop(reply_call_id(header), None)
            if entry is None:
                continue  # its caller gave up: the connection dropped in between
            request_type, future = entry
            value, error = decode_reply(request_type, header, payload)
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        for event, value in monitor_events(monitor):
            failure = handshake_failure(event, value, self.url, self.credential,
                                        self._credential_path)
            if failure is not None:
                if failure != self.auth_error and self._established:
                    log.error("kvdepot: %s", failure)  # once per cause, not per retry
                self.auth_error = failure
                if event & ENDS_THE_SESSION:
                    self._reconnect_at = time.monotonic() + RECONNECT_AFTER_REFUSAL
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.auth_error = None
                self._established = True
                self._connected.set()
            elif event == zmq.EVENT_DISCONNECTED:
                self._connected.clear()
                self._fail_all(ServerUnavailable(
                    f"connection to kvdepot server at {self.url} dropped"))
                for callback in self.on_disconnect:
                    callback()

    def _fail_all(self, error: ServerUnavailable) -> None:
        pending, self._pending = self._pending, {}
        for _, future in pending.values():
            future.set_exception(error)


def wait_for_server(url: str, timeout: float,
                    process: subprocess.Popen | None = None,
                    credentials: str | None = None) -> None:
    """Block until a server answers at `url` (tests, benchmarks, the demo); with the
    server's `process`, fail at once if it exits instead."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise ServerUnavailable(f"kvdepot serve exited with status {process.returncode} "
                                    f"before answering at {url}")
        try:
            conn = DepotConnection(url, connect_timeout=min(2.0, timeout),
                                   credentials=credentials)
        except ServerUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        try:
            conn.call(RequestType.PING, timeout=max(0.1, deadline - time.monotonic()))
            return
        finally:
            conn.close()
