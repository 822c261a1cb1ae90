"""Another user's attacks on the server's HTTP listeners, run as a child under setpriv.

  setpriv --reuid=U ... python -m tests.support.http_flood hold PORTS CONNECTIONS [again] [silent]
  setpriv --reuid=U ... python -m tests.support.http_flood request PORT KIND

`hold`: opens up to CONNECTIONS TCP connections spread over the comma-separated PORTS
of 127.0.0.1, sends half a request line on each, and never sends another byte. It
prints {"held": N} once they are connected, then answers each line on stdin
("report") with {"closed": K, "longest": S, "within_a_second": Q}: how many of them the
server has ended, the longest any of those lived (seconds from connect) and how many
it ended within a second of connecting. With `again`, each connection the server ends
is replaced by a new one; with `silent` it sends nothing at all (as a raw flood of a
ZeroMQ socket: a byte that is not a greeting would end the connection at once). Its
stdin closing ends it.

`request`: one hostile request, then one JSON line of what the server did:
  slow:      a request line and headers, one byte every 0.5 s, never finished;
  headers:   a request whose headers are 1 MiB;
  body:      a POST declaring a 16 MiB body, of which it sends nothing;
  chunked:   a POST with a chunked body that never ends;
  keepalive: a whole GET, its response read, then nothing.
{"status": the HTTP status the server answered (0: none), "lived": seconds from
connect to the server's end of the connection, "ended": whether it ended it}.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time

from tests.support.descriptor_flood import Watcher, connect_batch, raise_own_limit

HALF_REQUEST = b"GET /healthz HT"
GIVE_UP_S = 60.0
"""A `request` attack stops waiting for the server's end after this long."""


def hold(ports: list[int], wanted: int, again: bool, silent: bool = False) -> None:
    room = raise_own_limit() - 32
    target = min(wanted, room)
    watcher = ClosingWatcher()
    held: list[socket.socket] = []
    while len(held) < target:
        port = ports[len(held) // 256 % len(ports)]
        batch = connect_batch(port, min(256, target - len(held)), watcher)
        if not batch:
            break
        for sock in batch if not silent else ():
            with contextlib.suppress(OSError):  # reset already: the watcher counts it
                sock.send(HALF_REQUEST)
        held.extend(batch)
    print(json.dumps({"held": len(held)}), flush=True)
    if again:
        threading.Thread(target=_refill, args=(ports, watcher, silent), daemon=True).start()
    for line in sys.stdin:
        if line.strip() == "report":
            print(json.dumps(watcher.report()), flush=True)
    for sock in held:
        sock.close()


class ClosingWatcher(Watcher):
    """The flood's watcher, which also closes each connection once the server has ended
    it: a flood that replaces them would otherwise run out of descriptors."""

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
                    sock.close()
                    with self.lock:
                        self.lifetimes.append(time.monotonic() - key.data)


def _refill(ports: list[int], watcher: Watcher, silent: bool) -> None:
    """Replace each connection the server ends with a new one, at most 256 at a time, so
    that the bounds stay under pressure however long the server takes to judge."""
    replaced = 0
    while True:
        time.sleep(0.1)
        missing = min(256, int(watcher.report()["closed"]) - replaced)
        if missing > 0:
            for sock in connect_batch(ports[replaced % len(ports)], missing, watcher):
                if silent:
                    continue
                with contextlib.suppress(OSError):
                    sock.send(HALF_REQUEST)
            replaced += missing


def _status(data: bytes) -> int:
    if data.startswith(b"HTTP/1.1 "):
        return int(data[9:12])
    return 0


def request(port: int, kind: str) -> dict[str, float | int | bool]:
    sock = socket.create_connection(("127.0.0.1", port))
    started = time.monotonic()
    sock.settimeout(0.5)
    received = b""
    ended = False
    pieces: list[bytes] = []
    if kind == "slow":
        pieces = [bytes([b]) for b in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200]
    elif kind == "headers":
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
                     + b"X-Pad: " + b"a" * (1 << 20) + b"\r\n\r\n")
    elif kind == "body":
        sock.sendall(b"POST /v1/clear HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 16777216\r\n\r\n")
    elif kind == "chunked":
        sock.sendall(b"POST /v1/clear HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"10\r\n{}              \r\n")
    elif kind == "keepalive":
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    while time.monotonic() - started < GIVE_UP_S:
        if pieces:
            try:
                sock.send(pieces.pop(0))
            except OSError:
                ended = True
                break
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            ended = True
            break
        if not data:
            ended = True
            break
        received += data
    lived = time.monotonic() - started
    sock.close()
    return {"status": _status(received), "lived": lived, "ended": ended}


def main() -> None:
    assert os.geteuid() != 0, "run me as another user (setpriv)"
    if sys.argv[1] == "hold":
        hold([int(p) for p in sys.argv[2].split(",")], int(sys.argv[3]), "again" in sys.argv[4:],
             "silent" in sys.argv[4:])
    else:
        print(json.dumps(request(int(sys.argv[2]), sys.argv[3])), flush=True)


if __name__ == "__main__":
    main()
