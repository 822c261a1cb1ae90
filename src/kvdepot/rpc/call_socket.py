"""Blocking calls made on the caller's own thread, without the I/O thread in between.

A lookup is on the engine scheduler's critical path. Handing it to the I/O thread and
waking the caller again costs two thread switches per call, a visible share of a lookup's
budget (docs/benchmarks.md). So blocking calls (and the
fire-and-forget notices of the same clients, which must stay in order with them) use a
second DEALER socket that the calling thread drives itself: send, then poll for the
reply. A lock lets any thread use it, one at a time; ZeroMQ allows a socket to move
between threads when a full memory barrier (the lock) separates the uses.

Replies to notices are read by whichever call comes next, and before every send, so
they never pile up in the socket; error replies to notices are logged, as the I/O
thread does for its fire-and-forget requests.

A notice never waits for the lock: while a call holds it (a heartbeat PING to a stalled
server waits up to its timeout), the notice is queued and the holder sends it at its
next poll slice, or as it lets go of the socket. Queued notices always go out before the
next request, so the order of a client's messages is kept.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Any

import zmq

from kvdepot.errors import AuthenticationFailed, ServerUnavailable
from kvdepot.protocol import RequestType
from kvdepot.rpc.credentials import Credential
from kvdepot.rpc.dealer import (
    ENDS_THE_SESSION,
    RECONNECT_AFTER_REFUSAL,
    handshake_failure,
    monitor_events,
    open_dealer,
    reconnect,
    send_request,
)
from kvdepot.rpc.replies import decode_reply, reply_call_id

log = logging.getLogger(__name__)

_POLL_SLICE_MS = 50
"""A blocked call wakes this often to notice `close()`."""

_MAX_UNANSWERED_NOTICES = 4096
"""Notices whose replies never came (the server restarted) are forgotten beyond this."""


class CallSocket:
    def __init__(self, context: zmq.Context, url: str, connect_timeout: float,
                 credential: Credential | None, credential_path: str | None = None) -> None:
        self.url = url
        self._credential = credential
        self._credential_path = credential_path
        self.auth_error: str | None = None
        """Why the last handshake failed, until one succeeds."""
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._notices: dict[int, RequestType] = {}
        self._queued: collections.deque[tuple[RequestType, bytes]] = collections.deque(
            maxlen=_MAX_UNANSWERED_NOTICES)
        """Notices waiting for the call that holds the socket to send them."""
        self._closed = False
        self._reconnect_at: float | None = None
        """When to connect again after a handshake libzmq gave up on (checked by the
        next use: the heartbeat's pings come at least once a second while down)."""
        self._sock, self._monitor = open_dealer(context, url, credential)
        self._connected = False
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        deadline = time.monotonic() + connect_timeout
        while (not self._connected and self.auth_error is None
               and time.monotonic() < deadline):
            if self._monitor.poll(_POLL_SLICE_MS):
                self._read_monitor()
        if self.auth_error is not None and not self._connected:
            self._close_sockets()
            raise AuthenticationFailed(self.auth_error)
        if not self._connected:
            self._close_sockets()
            raise ServerUnavailable(f"kvdepot server at {url} accepted a TCP connection but did "
                                    f"not complete the ZeroMQ handshake within {connect_timeout} s")

    def call(self, request_type: RequestType, body: bytes, timeout: float) -> Any:
        """Send a request and wait for its reply: the value, or the server's error raised
        at once; ServerUnavailable as soon as the connection is known to be down."""
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=max(0.0, timeout)):
            raise TimeoutError(f"no reply within {timeout} s (the call socket stayed busy)")
        try:
            call_id = self._send(request_type, body)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no reply within {timeout} s")
                ready = dict(self._poller.poll(min(remaining * 1000, _POLL_SLICE_MS)))
                if self._closed:
                    raise ServerUnavailable(f"connection to {self.url} is closed")
                self._send_queued()
                if self._monitor in ready and self._read_monitor():
                    raise ServerUnavailable(f"connection to kvdepot server at {self.url} dropped")
                if self._sock in ready:
                    frames = self._read_replies(call_id)
                    if frames is not None:
                        value, error = decode_reply(request_type, *frames)
                        if error is not None:
                            raise error
                        return value
        finally:
            self._lock.release()
            self._send_queued_if_free()

    def notify(self, request_type: RequestType, body: bytes) -> None:
        """Send without waiting; an error reply is logged when a later use reads it.
        Raises ServerUnavailable when the server is known not to be connected."""
        if self._closed:
            raise ServerUnavailable(f"connection to {self.url} is closed")
        if not self._lock.acquire(blocking=False):
            self._queued.append((request_type, body))
            self._send_queued_if_free()  # the holder may have let go meanwhile
            return
        try:
            self._notice(request_type, body)  # after any queued ones (`_send`)
        finally:
            self._lock.release()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._close_sockets()

    def _send_queued_if_free(self) -> None:
        while self._queued and self._lock.acquire(blocking=False):
            try:
                self._send_queued()
            finally:
                self._lock.release()

    # ---- under the lock -----------------------------------------------------------------
    def _notice(self, request_type: RequestType, body: bytes, queued: bool = False) -> None:
        if not queued:
            call_id = self._send(request_type, body)
        elif self._closed or not self._connected:
            raise ServerUnavailable(f"kvdepot server at {self.url} is not connected")
        else:
            call_id = self._send_now(request_type, body)  # `_send` would flush the queue
        self._notices[call_id] = request_type
        if len(self._notices) > _MAX_UNANSWERED_NOTICES:
            del self._notices[next(iter(self._notices))]

    def _send_queued(self) -> None:
        """Send the notices queued while the socket was busy. Those the connection cannot
        take are dropped: the call holding the socket finds the connection down itself,
        and its client goes degraded."""
        while self._queued:
            request_type, body = self._queued.popleft()
            try:
                self._notice(request_type, body, queued=True)
            except ServerUnavailable:
                log.debug("dropped %d queued notices: not connected", len(self._queued) + 1)
                self._queued.clear()

    def _send(self, request_type: RequestType, body: bytes) -> int:
        if self._closed:
            raise ServerUnavailable(f"connection to {self.url} is closed")
        if self._monitor.poll(0):
            self._read_monitor()
        if self._reconnect_at is not None and time.monotonic() >= self._reconnect_at:
            self._reconnect_at = None
            reconnect(self._sock, self.url)
        why = f" ({self.auth_error})" if self.auth_error else ""
        not_connected = f"kvdepot server at {self.url} is not connected{why}"
        # Known down until a new handshake: ZeroMQ may still hold the dropped connection's
        # pipe for a moment and would take the request into it, where no reply can come.
        if not self._connected:
            raise ServerUnavailable(not_connected)
        self._read_replies(None)
        if self._queued:
            self._send_queued()  # queued notices came first
        return self._send_now(request_type, body, not_connected)

    def _send_now(self, request_type: RequestType, body: bytes,
                  not_connected: str = "") -> int:
        call_id = next(self._ids) & 0xFFFFFFFF
        try:
            send_request(self._sock, call_id, request_type, body)
        except zmq.Again:
            raise ServerUnavailable(not_connected or f"kvdepot server at {self.url} is not "
                                    "connected") from None
        return call_id

    def _read_replies(self, wanted: int | None) -> tuple[bytes, bytes] | None:
        """Read every waiting reply: notices' replies are settled, and the frames of call
        `wanted` are returned as soon as they come (anything else is a reply to a call
        that gave up)."""
        while True:
            try:
                header, payload = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return None
            call_id = reply_call_id(header)
            if call_id == wanted:
                return header, payload
            request_type = self._notices.pop(call_id, None)
            if request_type is not None:
                _, error = decode_reply(request_type, header, payload)
                if error is not None:
                    log.warning("kvdepot %s failed: %s", request_type.name, error)

    def _read_monitor(self) -> bool:
        """Apply the monitor's events; returns whether the connection dropped (even if it
        is back already: what was in flight on it is lost either way)."""
        dropped = False
        for event, value in monitor_events(self._monitor):
            failure = handshake_failure(event, value, self.url, self._credential,
                                        self._credential_path)
            if failure is not None:
                self.auth_error = failure
                if event & ENDS_THE_SESSION:
                    self._reconnect_at = time.monotonic() + RECONNECT_AFTER_REFUSAL
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
                self.auth_error = None
            elif event == zmq.EVENT_DISCONNECTED:
                self._connected = False
                dropped = True
                self._notices.clear()  # their replies will never come
        return dropped

    def _close_sockets(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
