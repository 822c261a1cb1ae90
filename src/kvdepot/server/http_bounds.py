"""Bounds on the server's HTTP listeners (the admin API and the Prometheus metrics).

Anyone who can reach an HTTP port can open connections to it, and uvicorn, left to its
defaults, keeps each one until its client sends a whole request: no deadline for a
request's first byte or its headers. Another user's 24,000 idle connections to the
admin port once held the server at its descriptor limit, and new engines could not
connect. So both listeners are served by uvicorn's HTTP/1.1 protocol (h11) with
uvicorn's own limits where it has them (the header block's size, the keep-alive idle
time) and, added here, what it lacks:

- a bound per peer and one for all peers of both listeners together, judged as each
  connection is accepted (before any TLS handshake); a connection past either is reset
  at once. A peer is the local user on loopback (`socket_owner`), its address beyond;
- a deadline for each request, from the connection's accept or the end of the previous
  response until the request is whole (headers and body): a slow sender is reset;
- a cap on a request's body, declared up front (a body must come with Content-Length).

Every refusal is counted (`http_*` metrics). The figures and why: docs/server.md#bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import ssl
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvdepot.log_limiter import LogLimiter
from kvdepot.metrics import Counter, MetricsRegistry
from kvdepot.rpc.socket_owner import SocketOwners

log = logging.getLogger(__name__)
refusals_log = LogLimiter(log)

MAX_CONNECTIONS = 256
"""HTTP connections of all peers together, over both listeners. A probe, a scraper and a
few dashboards hold about ten; lowered to `SHARE` of the descriptor limit."""
SHARE = 32
"""The HTTP listeners together hold at most 1/SHARE of the descriptor limit."""
MAX_PER_PEER = 32
"""HTTP connections one peer may hold: a browser opens six per host, and a peer is a
whole local user on loopback (its probes, scraper and browsers together)."""
PEERS_THAT_FIT = 4
"""The bound per peer is at most 1/PEERS_THAT_FIT of the total, so one user holding its
bound leaves room for three others (a probe, a scraper, a browser)."""
REQUEST_DEADLINE_S = 5.0
"""A request must be whole (headers and body) this long after its connection was
accepted or the previous response sent; a TLS handshake counts against it too."""
KEEP_ALIVE_S = 5
"""An idle keep-alive connection is closed after this long (uvicorn's own limit)."""
MAX_HEADER_BYTES = 16 << 10
"""The request line and headers (h11's limit of an incomplete event); past it, 400."""
MAX_BODY_BYTES = 64 << 10
"""The largest request body either listener takes: the admin API's bodies are small
JSON objects, and the metrics listener takes none."""
BACKLOG = 64
"""asyncio accepts up to the backlog's length of connections per loop round before any
is judged, so a burst holds at most this many descriptors for a moment."""


def _limit_share(limit: int) -> tuple[int, int]:
    total = max(PEERS_THAT_FIT, min(MAX_CONNECTIONS, limit // SHARE))
    return total, max(1, min(MAX_PER_PEER, total // PEERS_THAT_FIT))


@dataclass
class HttpBounds:
    """The connection counts shared by every HTTP listener of the process, and the
    counters of what was refused. Listeners run on threads of their own, hence the lock."""

    descriptor_limit: int
    metrics: MetricsRegistry | None = None
    total: int = field(init=False)
    per_peer: int = field(init=False)

    def __post_init__(self) -> None:
        self.total, self.per_peer = _limit_share(self.descriptor_limit)
        registry = self.metrics or MetricsRegistry()
        self.refused_peer: Counter = registry.counter("http_connections_refused_peer")
        self.refused_total: Counter = registry.counter("http_connections_refused_all_peers")
        self.timed_out: Counter = registry.counter("http_requests_timed_out")
        self.too_large: Counter = registry.counter("http_requests_refused")
        self.owners = SocketOwners()
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self._count = 0

    def admit(self, peer: str) -> bool:
        """Take a place for a connection of `peer`; False (and counted) if it has none."""
        with self._lock:
            held = self._held.get(peer, 0)
            if held >= self.per_peer:
                self.refused_peer.add()
                refusals_log.warning("http-peer", "reset an HTTP connection from %s: it "
                                     "holds %d, the bound per peer", peer, held)
                return False
            if self._count >= self.total:
                self.refused_total.add()
                refusals_log.warning("http-total", "reset an HTTP connection from %s: the "
                                     "HTTP listeners hold %d, the bound for all peers",
                                     peer, self.total)
                return False
            self._held[peer] = held + 1
            self._count += 1
            return True

    def release(self, peer: str) -> None:
        with self._lock:
            self._count -= 1
            left = self._held[peer] - 1
            if left:
                self._held[peer] = left
            else:
                del self._held[peer]

    def held(self) -> dict[str, int]:
        """Connections per peer now (for tests and status)."""
        with self._lock:
            return dict(self._held)

    def peer_of(self, transport: asyncio.BaseTransport) -> str:
        """Who holds the connection: the local user on loopback, else the address."""
        remote = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        if not isinstance(remote, tuple) or not isinstance(local, tuple):
            return "unix"
        host = str(remote[0])
        try:
            address = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return host
        mapped = getattr(address, "ipv4_mapped", None)
        if not (mapped or address).is_loopback:
            return host
        uid = self.owners.owner((host, int(remote[1])), (str(local[0]), int(local[1])))
        return host if uid is None else f"uid {uid}"


class _BoundedProtocol(H11Protocol):
    """uvicorn's h11 protocol, admitted by `bounds`, under the request deadline, with TLS
    (if any) started after admission. Subclassed per listener by `protocol_for`."""

    bounds: HttpBounds
    tls: ssl.SSLContext | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._peer: str | None = None
        self._raw: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._serving = False
        self._early = bytearray()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # Judged before anything is read (and before any TLS handshake): a refused
        # connection costs one accept and one reset.
        self._raw = transport
        peer = self.bounds.peer_of(transport)
        if not self.bounds.admit(peer):
            transport.abort()
            return
        self._peer = peer
        self._arm()
        if self.tls is None:
            self._serve(transport)
        else:
            # Nothing is read until the TLS layer takes the connection over (it resumes
            # reading): a ClientHello read before would be fed to the HTTP parser.
            transport.pause_reading()
            self.loop.create_task(self._start_tls(transport))

    async def _start_tls(self, transport: asyncio.Transport) -> None:
        try:
            secured = await self.loop.start_tls(transport, self, self.tls, server_side=True,
                                                ssl_handshake_timeout=REQUEST_DEADLINE_S)
        except Exception:  # a failed or timed-out handshake, or the server stopping
            transport.abort()
            self._release()
            return
        if secured is None:
            self._release()
            return
        self._serve(secured)

    def _serve(self, transport: asyncio.Transport) -> None:
        self._serving = True
        super().connection_made(transport)
        if self._early:
            early, self._early = bytes(self._early), bytearray()
            super().data_received(early)

    def data_received(self, data: bytes) -> None:
        if self._serving:
            super().data_received(data)
        else:  # decrypted before `start_tls` returned to us: kept for `_serve`
            self._early += data

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        if self._serving:
            super().connection_lost(exc)

    def _release(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._peer is not None:
            self.bounds.release(self._peer)
            self._peer = None

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(REQUEST_DEADLINE_S, self._expired)

    def _expired(self) -> None:
        self._deadline = None
        if self._serving and (self.timeout_keep_alive_task is not None
                              or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY)):
            return  # idle after a response (uvicorn's keep-alive ends it) or answering
        self.bounds.timed_out.add()
        refusals_log.warning("http-slow", "reset an HTTP connection from %s: no whole "
                             "request within %g s", self._peer, REQUEST_DEADLINE_S)
        if self._raw is not None:
            self._raw.abort()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._peer is not None and not self.transport.is_closing():
            self._arm()

    def send_400_response(self, msg: str) -> None:
        # h11 refuses a header block past MAX_HEADER_BYTES, and anything not HTTP/1.1.
        self.bounds.too_large.add()
        super().send_400_response(msg)


def protocol_for(bounds: HttpBounds, tls: ssl.SSLContext | None) -> type[H11Protocol]:
    """The protocol class uvicorn instantiates for each connection of one listener."""
    return type("BoundedH11Protocol", (_BoundedProtocol,), {"bounds": bounds, "tls": tls})


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class BodyCap:
    """ASGI middleware: a request body must declare its length (Content-Length) and
    stay within MAX_BODY_BYTES; otherwise 411 or 413, and the connection is closed
    (its body, unread, would otherwise be read as the next request)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]],
                 refused: Counter) -> None:
        self.app = app
        self.refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            length = headers.get(b"content-length", b"0")
            if b"transfer-encoding" in headers:
                return await self._refuse(send, 411, "a request body needs Content-Length")
            if not length.isdigit() or int(length) > MAX_BODY_BYTES:
                return await self._refuse(send, 413,
                                          f"request bodies are at most {MAX_BODY_BYTES} bytes")
        await self.app(scope, receive, send)

    async def _refuse(self, send: Send, status: int, message: str) -> None:
        self.refused.add()
        body = json.dumps({"error": message}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class BoundedHttpServer:
    """uvicorn serving `app` on the bound socket `sock`, within `bounds`, from a thread
    of its own until `stop()`."""

    def __init__(self, app: Any, sock: Any, bounds: HttpBounds, name: str,
                 tls: ssl.SSLContext | None = None) -> None:
        config = uvicorn.Config(BodyCap(app, bounds.too_large), log_config=None,
                                log_level="warning", access_log=False, lifespan="off",
                                http=protocol_for(bounds, tls), backlog=BACKLOG,
                                # asyncio's own loop: a transport paused in
                                # connection_made reads nothing before TLS takes it over
                                # (uvloop may have read the ClientHello already).
                                loop="asyncio",
                                timeout_keep_alive=KEEP_ALIVE_S,
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES)
        config.load()
        self._sock = sock
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"kvdepot-{name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        with contextlib.suppress(OSError):
            self._sock.close()
