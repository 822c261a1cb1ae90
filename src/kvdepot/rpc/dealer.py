"""The engine side's DEALER socket, as both the I/O thread and the call socket open it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvdepot.errors import MalformedPayload
from kvdepot.protocol import MAX_MESSAGE_BYTES, REQUEST_HEADER, RequestType
from kvdepot.rpc.credentials import Credential, describe_search

ZERO_COPY_MIN_BYTES = 4 << 20
"""Bodies this large are handed to ZeroMQ without a copy. Below it the copy is cheaper
than pyzmq's zero-copy bookkeeping (a free callback through its garbage-collector
thread); docs/benchmarks.md has the measurement."""


HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
ENDS_THE_SESSION = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
"""Handshake failures after which libzmq never reconnects by itself (it ends a connecting
socket's session on a protocol error: another mechanism, a refused credential). A
process that squats a stopped server's port with another mechanism would otherwise cut
its clients off from the server's restart for good (measured with libzmq 4.3.5)."""
RECONNECT_AFTER_REFUSAL = 1.0
"""Seconds before connecting again after such a failure (no tight loop against a
squatter that refuses at once)."""


def open_dealer(context: zmq.Context, url: str, credential: Credential | None
                ) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connecting to `url` presenting `credential`, and a monitor socket
    reporting its handshakes (succeeded or failed) and disconnections.

    ZMQ_IMMEDIATE: nothing is queued for a server that is not connected, so a send fails
    at once while it is down and a restarted server never receives stale requests.
    Reconnection is retried every 0.1-1 s, so service resumes soon after a restart.
    """
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    if credential is not None:
        credential.apply(sock, url)
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
    sock.connect(url)
    return sock, monitor


def reconnect(sock: zmq.Socket, url: str) -> None:
    """Connect `sock` to `url` again after a failure in `ENDS_THE_SESSION`; the pinned
    server key is checked again on the new connection."""
    with contextlib.suppress(zmq.ZMQError):  # the ended session may be gone already
        sock.disconnect(url)
    sock.connect(url)


def monitor_events(monitor: zmq.Socket) -> Iterator[tuple[int, int]]:
    """(event, value) of every event waiting on `monitor` (from `open_dealer`), oldest
    first, without blocking."""
    while True:
        try:
            message = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        yield message["event"], message["value"]


def check_request_size(request_type: RequestType, body: bytes) -> None:
    """MalformedPayload for a body past the server's ZMQ_MAXMSGSIZE. The server never
    answers such a message (libzmq drops the whole connection before reading it), so its
    sender would see only a dropped connection, and every other request in flight on it
    fail: say why here, before anything is sent."""
    if len(body) > MAX_MESSAGE_BYTES:
        raise MalformedPayload(
            f"a {request_type.name} request of {len(body)} bytes is larger than the "
            f"{MAX_MESSAGE_BYTES} bytes a kvdepot server accepts in one message (it would "
            "drop the connection); send fewer tokens or blocks per request")


def send_request(sock: zmq.Socket, call_id: int, request_type: RequestType, body: bytes) -> None:
    """Send one request without blocking; zmq.Again when the server is not connected
    (ZMQ_IMMEDIATE queues nothing for it), MalformedPayload when it is too large."""
    check_request_size(request_type, body)
    sock.send_multipart([REQUEST_HEADER.pack(call_id, request_type), body], flags=zmq.NOBLOCK,
                        copy=len(body) < ZERO_COPY_MIN_BYTES)


def handshake_failure(event: int, value: int, url: str, credential: Credential | None,
                      credential_path: str | None) -> str | None:
    """What a monitor event says about authentication, None if it is no handshake failure."""
    if not event & HANDSHAKE_FAILED:
        return None
    if credential is None:
        return (f"the kvdepot server at {url} requires a credential and this process has none "
                f"(looked for {describe_search(url, credential_path)})")
    what = f"credential {credential.name!r} from {credential.source}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the kvdepot server at {url} refused the {what} (status {value})"
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return (f"the kvdepot server at {url} speaks another security mechanism than the "
                f"{what} (was the server restarted with or without --insecure?)")
    return (f"the handshake with the kvdepot server at {url} failed with the {what}; "
            "does the credential name that server's public key?")
