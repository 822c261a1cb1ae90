"""Bounds on the connections one peer may hold to the server's ZeroMQ sockets.

Anyone who can reach a listening port can open TCP connections to it, and libzmq
accepts each one (a descriptor) before any handshake authenticates it. Another local
user once held 1,100 such connections: the server sat at its 1,024-descriptor limit,
new clients got no answer, and (reading "too many open files" as "the process is gone")
it dropped a live engine's registration. Three things stop that:

- the server's soft RLIMIT_NOFILE is raised to the hard limit at start
  (`kvdepot.server.serve.raise_descriptor_limit`);
- every listening socket drops a connection that has not finished its handshake within
  `HANDSHAKE_INTERVAL_MS` (`harden`);
- a `ConnectionGuard` watches each listening socket's accepted connections (a ZeroMQ
  socket monitor: EVENT_ACCEPTED carries the new descriptor, EVENT_DISCONNECTED the
  one that went away), tells who the peer is, and shuts down a connection past the
  bound of its peer or past the bound of all guarded connections together.

Who the peer is: beyond loopback its IP address. On loopback every peer has the same
address, so the peer is the local user that owns the other end: the uid the kernel
reports for the client's socket of the connection (`kvdepot.rpc.socket_owner`, by the
connection's 4-tuple). On a Unix socket (ipc://) it is the uid SO_PEERCRED reports.

A descriptor that libzmq owns is never closed here: the guard works on a dup(2) of it
and ends the connection with shutdown(2), which libzmq then sees as the peer going
away (it closes its descriptor and reports EVENT_DISCONNECTED).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import resource
import socket
import struct
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvdepot.log_limiter import LogLimiter
from kvdepot.rpc.socket_owner import SocketOwners

log = logging.getLogger(__name__)
refusals_log = LogLimiter(log)

HANDSHAKE_INTERVAL_MS = 5000
"""A connection that has not finished its ZeroMQ handshake (greeting, CURVE,
the ZAP answer) this long after it was accepted is dropped. A loopback handshake takes
about a millisecond, and CURVE over a long link a few round trips (under a second even
at 300 ms RTT), so 5 s leaves room for a loaded server whose ZAP thread waits for the
GIL; libzmq's default (30 s) let a flood keep each descriptor six times as long."""

MAX_CONNECTIONS_PER_PEER = 1024
"""The most connections one peer (a local uid, or a remote IP address) may hold to one
server at a time, counted over all its listening sockets. An engine process holds a few
(its scheduler's or worker's request connection, a KV-event subscriber), so a node of
8 engines x TP 8 as one user (72 processes) holds about 300 even while restarting
engines' old connections linger: a third of the bound. Lowered to `PEER_SHARE` of the
descriptor limit where that limit is small."""

PEER_SHARE = 8
"""One peer may hold at most 1/PEER_SHARE of the server's descriptor limit."""

TOTAL_SHARE = 2
"""All guarded connections together may hold at most 1/TOTAL_SHARE of the server's
descriptor limit: the rest stays for registrations' memory files, handover tickets,
disk tier files and the server's own sockets, whatever many peers do."""

EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
          | zmq.EVENT_MONITOR_STOPPED)
"""MONITOR_STOPPED too: closing the guarded socket sends it, which ends the guard."""
_POLL_MS = 200
_SWEEP_S = 1.0
"""How often entries of connections whose disconnection event was missed are dropped."""
_BATCH = 1024
"""Monitor events handled per round."""


LISTEN_BACKLOG = 1024
"""Connections the kernel queues for accept (libzmq's default is 100; the kernel caps it
at net.core.somaxconn). A burst larger than the queue (a node's workers starting at once,
or a flood the guard is busy ending) has its SYNs dropped, and a dropped SYN is retried
only after a second: measured here, 2,048 connections took 8 s with 100 and 1 s with
1,024. Queued connections hold no descriptor of the server."""


def harden(sock: zmq.Socket) -> None:
    """Options every listening socket of the server gets before it binds."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_INTERVAL_MS)
    sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)


def descriptor_limit() -> int:
    """This process's soft RLIMIT_NOFILE (a large figure for 'unlimited')."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


@dataclass(frozen=True)
class _Tracked:
    peer: str
    inode: int
    """The socket's inode: tells the connection from a later one given the same number."""


class _Connections:
    """Every guarded connection of this process, by descriptor (descriptors are unique
    in a process, so the sockets' guards share one table and one count per peer)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_fd: dict[int, _Tracked] = {}
        self.per_peer: dict[str, int] = {}

    def add(self, fd: int, tracked: _Tracked) -> None:
        self.remove(fd)
        self.by_fd[fd] = tracked
        self.per_peer[tracked.peer] = self.per_peer.get(tracked.peer, 0) + 1

    def remove(self, fd: int) -> None:
        tracked = self.by_fd.pop(fd, None)
        if tracked is None:
            return
        left = self.per_peer[tracked.peer] - 1
        if left:
            self.per_peer[tracked.peer] = left
        else:
            del self.per_peer[tracked.peer]

    def forget_stale(self) -> None:
        """Drop entries whose descriptor is closed or now names another socket (a
        disconnection whose event was lost would otherwise count against its peer
        forever). fstat needs no new descriptor."""
        for fd, tracked in list(self.by_fd.items()):
            try:
                inode = os.fstat(fd).st_ino
            except OSError:
                inode = -1
            if inode != tracked.inode:
                self.remove(fd)


_CONNECTIONS = _Connections()
_OWNERS = SocketOwners()
"""Asks the kernel who owns a connection's client end over one netlink socket kept open:
reading /proc/net/tcp instead needed a descriptor, and a server at its limit then took
every flooding user for one peer (their address)."""


def peer_counts() -> dict[str, int]:
    """Guarded connections per peer now (for tests and status)."""
    with _CONNECTIONS.lock:
        return dict(_CONNECTIONS.per_peer)


def _is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


@dataclass
class _Accepted:
    fd: int
    dup: socket.socket
    inode: int
    peer: str
    ends: tuple[tuple[str, int], tuple[str, int]] | None = None
    """(client's address, server's address), for a loopback TCP peer."""


class ConnectionGuard:
    """Watches one bound socket's connections on a thread of its own (see the module)."""

    def __init__(self, sock: zmq.Socket, name: str, limit: int | None = None) -> None:
        """`sock` is bound already; `name` says which socket in log lines."""
        self.name = name
        limit = limit or descriptor_limit()
        self.per_peer = max(1, min(MAX_CONNECTIONS_PER_PEER, limit // PEER_SHARE))
        self.total = max(1, limit // TOTAL_SHARE)
        self._sock = sock
        self._monitor = sock.get_monitor_socket(EVENTS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvdepot-guard-{name}",
                                        daemon=True)
        self._thread.start()

    def close_socket(self, linger: int) -> None:
        """Close the guarded socket, which may still send for `linger` ms; on the socket's
        own thread. Monitoring ends first: a socket still sending reports events, and a
        report to a monitor nobody reads any more blocks the ZeroMQ I/O thread, and with
        it every connection that thread serves. The guard's thread then ends."""
        self._sock.disable_monitor()
        self._sock.close(linger=linger)

    def stop(self) -> None:
        """Ends the thread (closing the guarded socket ends it too)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        next_sweep = time.monotonic() + _SWEEP_S
        try:
            while not self._stop.is_set():
                if self._monitor.poll(_POLL_MS) and not self._round():
                    return
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + _SWEEP_S
                    with _CONNECTIONS.lock:
                        _CONNECTIONS.forget_stale()
        except zmq.ZMQError:
            return  # the context is terminating
        except Exception:
            log.exception("the connection guard of the %s socket failed", self.name)
        finally:
            self._monitor.close(linger=0)

    def _round(self) -> bool:
        """Handle the monitor events waiting now; False once monitoring has stopped."""
        accepted: list[_Accepted] = []
        going = True
        for _ in range(_BATCH):
            try:
                event = recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            kind, fd = event["event"], event["value"]
            if kind == zmq.EVENT_MONITOR_STOPPED:
                going = False
                break
            if kind == zmq.EVENT_ACCEPTED:
                found = self._inspect(fd)
                if found is not None:
                    accepted.append(found)
            else:
                # Events arrive in order: one for a descriptor accepted in this round
                # ends that connection before the round is judged.
                for ended in [a for a in accepted if a.fd == fd]:
                    ended.dup.close()
                    accepted.remove(ended)
                with _CONNECTIONS.lock:
                    _CONNECTIONS.remove(fd)
        if accepted:
            self._judge(accepted)
        return going

    def _inspect(self, fd: int) -> _Accepted | None:
        """The connection on descriptor `fd`, through a dup of it; None if it is gone
        already (or the number names something else by now)."""
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            return None  # closed since (EBADF), not a socket, or no descriptor free
        try:
            inode = os.fstat(dup.fileno()).st_ino
            if dup.family == socket.AF_UNIX:
                uid = struct.unpack("3i", dup.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
                return _Accepted(fd, dup, inode, f"uid {uid}")
            remote = dup.getpeername()
            local = dup.getsockname()
        except OSError:
            dup.close()
            return None
        host = remote[0]
        if not _is_loopback(host):
            return _Accepted(fd, dup, inode, host)
        return _Accepted(fd, dup, inode, host, ((host, remote[1]), (local[0], local[1])))

    def _judge(self, accepted: list[_Accepted]) -> None:
        for conn in accepted:
            if conn.ends is not None:
                uid = _OWNERS.owner(*conn.ends)
                if uid is not None:
                    conn.peer = f"uid {uid}"
        with _CONNECTIONS.lock:
            for conn in accepted:
                held = _CONNECTIONS.per_peer.get(conn.peer, 0)
                if held >= self.per_peer or len(_CONNECTIONS.by_fd) >= self.total:
                    self._refuse(conn, held)
                else:
                    _CONNECTIONS.add(conn.fd, _Tracked(conn.peer, conn.inode))
                conn.dup.close()

    def _refuse(self, conn: _Accepted, held: int) -> None:
        if held >= self.per_peer:
            refusals_log.warning(
                f"peer-{self.name}", "closed a connection to the %s socket from %s: it holds "
                "%d connections already, the bound per peer", self.name, conn.peer, held)
        else:
            refusals_log.warning(
                f"total-{self.name}", "closed a connection to the %s socket from %s: the "
                "server holds %d connections, the bound for all peers (1/%d of its "
                "descriptor limit)", self.name, conn.peer, self.total, TOTAL_SHARE)
        with contextlib.suppress(OSError):  # ended by the peer meanwhile
            conn.dup.shutdown(socket.SHUT_RDWR)
