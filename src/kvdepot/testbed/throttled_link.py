"""A slow network link on loopback: a TCP proxy whose connections share one bandwidth.

Stands for the link between a node and a distant Redis (another rack, another zone) in
the load-or-compute benchmark and tests: every byte each way waits for its turn at
`bytes_per_s`, whatever the number of connections, as on one shared link. The rate may
change while connections are open (None: no limit).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

READ_BYTES = 16 << 10
"""Bytes forwarded per turn: small enough that the pace is smooth at a few MB/s."""


class _Pace:
    """One direction of the link: each slice of bytes ends `n / rate` after the last."""

    def __init__(self) -> None:
        self.bytes_per_s: float | None = None
        self._free_at = 0.0
        self._mutex = threading.Lock()

    def wait(self, nbytes: int) -> None:
        with self._mutex:
            rate = self.bytes_per_s
            if rate is None:
                return
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + nbytes / rate
            until = self._free_at
        time.sleep(max(0.0, until - time.monotonic()))


class ThrottledLink:
    def __init__(self, target: tuple[str, int], bytes_per_s: float | None = None) -> None:
        self.target = target
        self._upstream = _Pace()
        self._downstream = _Pace()
        self.bytes_per_s = bytes_per_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._mutex = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="throttled-link", daemon=True).start()

    @property
    def bytes_per_s(self) -> float | None:
        return self._downstream.bytes_per_s

    @bytes_per_s.setter
    def bytes_per_s(self, rate: float | None) -> None:
        self._upstream.bytes_per_s = self._downstream.bytes_per_s = rate

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                # As Redis and redis-py do: no Nagle delay waiting for the peer's ACK.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._mutex:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            for source, sink, pace in ((client, server, self._upstream),
                                       (server, client, self._downstream)):
                threading.Thread(target=self._pump, args=(source, sink, pace),
                                 daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, pace: _Pace) -> None:
        try:
            while data := source.recv(READ_BYTES):
                pace.wait(len(data))
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> ThrottledLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
