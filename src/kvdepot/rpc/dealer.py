"""The engine side's DEALER socket, as both the I/O thread and the call socket open it."""

from __future__ import annotations

import zmq

from kvdepot.protocol import REQUEST_HEADER, RequestType

ZERO_COPY_MIN_BYTES = 4 << 20
"""Bodies this large are handed to ZeroMQ without a copy. Below it the copy is cheaper
than pyzmq's zero-copy bookkeeping (a free callback through its garbage-collector
thread): on the 2-core development VM a 128 KiB request (a 32k-token lookup) made the
round trip 0.06 ms slower without the copy, and copying still won at 1 MiB."""


def open_dealer(context: zmq.Context, url: str) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connecting to `url`, and a monitor socket reporting its handshakes and
    disconnections.

    ZMQ_IMMEDIATE: nothing is queued for a server that is not connected, so a send fails
    at once while it is down and a restarted server never receives stale requests.
    Reconnection is retried every 0.1-1 s, so service resumes soon after a restart.
    """
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    sock.connect(url)
    return sock, monitor


def send_request(sock: zmq.Socket, call_id: int, request_type: RequestType, body: bytes) -> None:
    """Send one request without blocking; zmq.Again when the server is not connected
    (ZMQ_IMMEDIATE queues nothing for it)."""
    sock.send_multipart([REQUEST_HEADER.pack(call_id, request_type), body], flags=zmq.NOBLOCK,
                        copy=len(body) < ZERO_COPY_MIN_BYTES)
