"""Another user's flood of raw TCP connections that never handshake, run as a child.

  python -m tests.support.descriptor_flood PORT CONNECTIONS

Run as root, it drops to uid/gid 65534 (nobody) first, raises its soft RLIMIT_NOFILE to
the hard limit, and opens up to CONNECTIONS plain TCP connections to 127.0.0.1:PORT
(fewer if its limit is lower). It never sends a byte. It prints one JSON line,
{"held": N}, once they are connected, then answers each line on stdin ("closed") with
{"closed": K, "longest": S, "within_a_second": Q}: how many of them the server has
ended since, the longest any of those lived (connect to end, seconds), and how many of
them it ended within a second. Its stdin closing ends it.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import selectors
import socket
import sys
import threading
import time

NOBODY = 65534
BATCH = 256
"""Connections started at once: about what the listener's backlog takes (a full backlog
drops SYNs, and a dropped SYN is retried only after a second)."""
CONNECT_TIMEOUT = 5.0


def drop_to_nobody() -> None:
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    assert os.geteuid() != 0


def raise_own_limit() -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


class Watcher:
    """Notes when the server ends each held connection (what the server sends first, its
    greeting, is read and thrown away), on a thread of its own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lifetimes: list[float] = []
        """Seconds from connecting to the server's end, of each connection ended."""
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def watch(self, sock: socket.socket, connected: float) -> None:
        """Watch `sock` from now on (epoll takes registrations while another thread waits
        in it)."""
        self._selector.register(sock, selectors.EVENT_READ, connected)

    def _run(self) -> None:
        while True:
            for key, _ in self._selector.select(timeout=0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    ended = not sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:  # reset
                    ended = True
                if ended:
                    self._selector.unregister(sock)
                    with self.lock:
                        self.lifetimes.append(time.monotonic() - key.data)

    def report(self) -> dict[str, float]:
        with self.lock:
            return {"closed": len(self.lifetimes),
                    "longest": max(self.lifetimes, default=0.0),
                    "within_a_second": sum(t < 1.0 for t in self.lifetimes)}


def connect_batch(port: int, count: int, watcher: Watcher) -> list[socket.socket]:
    """`count` connections to the port, connected (and watched from the moment each
    is); ones that failed are left out."""
    pending: list[socket.socket] = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        code = sock.connect_ex(("127.0.0.1", port))
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            continue
        pending.append(sock)
    done: list[socket.socket] = []
    with selectors.DefaultSelector() as selector:
        for sock in pending:
            selector.register(sock, selectors.EVENT_WRITE)
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                selector.unregister(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    done.append(sock)
                    watcher.watch(sock, time.monotonic())
                else:
                    sock.close()
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
    return done


def main() -> None:
    port, wanted = int(sys.argv[1]), int(sys.argv[2])
    drop_to_nobody()
    room = raise_own_limit() - 32  # stdin, stdout, the interpreter's own files
    held: list[socket.socket] = []
    target = min(wanted, room)
    watcher = Watcher()
    while len(held) < target:
        batch = connect_batch(port, min(BATCH, target - len(held)), watcher)
        if not batch:
            break
        held.extend(batch)
    print(json.dumps({"held": len(held), "limit": room + 32}), flush=True)
    for line in sys.stdin:
        if line.strip() == "closed":
            print(json.dumps(watcher.report()), flush=True)
    for sock in held:
        sock.close()


if __name__ == "__main__":
    main()
