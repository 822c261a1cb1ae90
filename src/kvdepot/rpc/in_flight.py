"""How many request bytes one connection may have inside the server at a time.

Issue 27: a client pipelining 32 MiB STOREs (junk block-id lists, well under the largest
message the protocol allows) over a few connections grew the server by about a gigabyte
and delayed other clients' PINGs by seconds. Its messages waited in two places, neither
bounded in bytes: ZeroMQ's receive queue of each connection (ZMQ_RCVHWM counts
messages, 1000 by default) and the transfer threads' queue (unbounded). Both are now
bounded per connection, from the protocol's own largest message:

- the ROUTER's receive queue holds `RECEIVE_QUEUE_MESSAGES` messages per connection; past
  that libzmq stops reading the connection, and TCP pushes back on the sender;
- requests handed to transfer threads hold at most `IN_FLIGHT_BYTES` of payload per
  connection until they are answered; one more is answered at once with an error that
  says so (a client that waits for its replies never sees it).

So one connection holds at most `CONNECTION_BYTES` of the server's memory in requests,
however fast it sends; how many connections one peer may hold is
`kvdepot.rpc.connection_guard`'s bound.
"""

from __future__ import annotations

import os
import threading

from kvdepot.protocol import MAX_MESSAGE_BYTES

RECEIVE_QUEUE_MESSAGES = 2
"""ZMQ_RCVHWM of the server's ROUTER. Requests are taken off this queue in microseconds
(decoding is zero-copy; copies run on transfer threads), so a short queue costs a
well-behaved client nothing: what it pipelines waits in its own send queue instead."""

RECEIVE_BUFFER_BYTES = 256 << 10
"""SO_RCVBUF of each connection to the ROUTER. libzmq's one I/O thread reads a large
message with one recv() per turn, and that recv() copies all the kernel holds for the
connection: with Linux's autotuning up to tcp_rmem's maximum (32 MiB on common hosts),
one flooding connection's turn took tens of milliseconds while every other client's
requests waited behind it. 256 KiB is a fraction of a millisecond's copy, and still
gigabytes a second at loopback and LAN round-trip times (requests carry ids, never KV)."""

IO_THREADS = max(4, min(16, len(os.sched_getaffinity(0))))
"""libzmq I/O threads of the server's context (libzmq's default is one): one per CPU,
at least 4 and at most 16. One thread serves each connection, and it decrypts a CURVE
message whole when its last byte arrives: for the largest request that takes tens of
milliseconds (docs/benchmarks.md), and every other connection of that thread waits. A new
connection goes to the least loaded thread, so until a peer holds as many connections as
there are threads, its large messages hold up only its own connections."""

IN_FLIGHT_BYTES = 2 * MAX_MESSAGE_BYTES
"""Payload bytes of one connection's requests running or queued on transfer threads. Two
of the largest requests: a client may always have one more in flight beside the
largest, and an engine's stores (a few KiB each, the token ids of a long prompt a few
MiB) pipeline by the hundred within it."""

CONNECTION_BYTES = (RECEIVE_QUEUE_MESSAGES + 2) * MAX_MESSAGE_BYTES + IN_FLIGHT_BYTES
"""The most request bytes one connection can hold in the server: its receive queue, the
message libzmq holds back while that queue is full and the one it is reading (+2), and
what is in flight. Replies are small, and ZeroMQ drops them past ZMQ_SNDHWM for a
client that does not read them."""


class InFlight:
    """Per connection (routing id), the payload bytes of requests admitted and not yet
    answered. `admit` runs on the control loop, `release` on whichever thread replies."""

    def __init__(self, limit: int = IN_FLIGHT_BYTES) -> None:
        self.limit = limit
        self._bytes: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def admit(self, connection: bytes, nbytes: int) -> bool:
        """Count `nbytes` against `connection`, unless that takes it past the limit. A
        connection with nothing in flight is always admitted: every request the protocol
        allows fits alone."""
        with self._lock:
            held = self._bytes.get(connection, 0)
            if held and held + nbytes > self.limit:
                return False
            self._bytes[connection] = held + nbytes
            return True

    def release(self, connection: bytes, nbytes: int) -> None:
        with self._lock:
            held = self._bytes.get(connection, 0) - nbytes
            if held > 0:
                self._bytes[connection] = held
            else:  # no entry outlives a connection's last request
                self._bytes.pop(connection, None)

    def held(self, connection: bytes) -> int:
        with self._lock:
            return self._bytes.get(connection, 0)

    def refusal(self, connection: bytes, nbytes: int) -> str:
        return (f"this connection already has {self.held(connection)} bytes of requests in "
                f"flight and the server takes at most {self.limit} per connection; a "
                f"{nbytes}-byte request more was refused: wait for replies before sending more")
