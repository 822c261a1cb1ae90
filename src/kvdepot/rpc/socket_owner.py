"""Which local user holds the other end of a loopback TCP connection.

On loopback every peer has the same address, so a bound "per peer" that means anything
there must name the user: the uid that owns the client's socket. The connection guard
of the ZeroMQ sockets reads /proc/net/tcp for that, once per batch of accepted
connections. The HTTP listeners judge one connection at a time, on their event loop,
and a flood fills /proc/net/tcp with tens of thousands of lines, each reading of which
would then stall the loop; so they ask the kernel for the one socket instead
(NETLINK_SOCK_DIAG with the connection's exact 4-tuple, as `ss` does), which answers in
tens of microseconds whatever the table's size. The netlink socket is opened once and
kept: a server out of descriptors can still tell who is flooding it.
"""

from __future__ import annotations

import socket
import struct
import threading

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NO_COOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr
_REQUEST = struct.Struct("=BBBxI")  # struct inet_diag_req_v2, up to its socket id
_PORTS = struct.Struct("!HH")  # the socket id's ports, in network order
_TAIL = struct.Struct("=III")  # the socket id's interface and cookie
_UID_OFFSET = _HEADER.size + 4 + 48 + 12
"""struct inet_diag_msg: 4 bytes of family and state, the 48-byte socket id, expires,
rqueue and wqueue, then the uid."""


class SocketOwners:
    """Looks up the owner of a TCP socket by its 4-tuple; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._sequence = 0

    def owner(self, local: tuple[str, int], remote: tuple[str, int]) -> int | None:
        """The uid owning the socket whose own address is `local` and whose peer is
        `remote` (for a server asking about its client: the client's address, then the
        server's own); None if the kernel knows no such socket or cannot be asked."""
        family = socket.AF_INET6 if ":" in local[0] else socket.AF_INET
        try:
            socket_id = (_PORTS.pack(local[1], remote[1]) + _address(family, local[0])
                         + _address(family, remote[0]) + _TAIL.pack(0, _NO_COOKIE, _NO_COOKIE))
        except (OSError, ValueError):
            return None
        body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, _ALL_STATES) + socket_id
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM,
                                               _NETLINK_SOCK_DIAG)
                    self._sock.settimeout(1.0)
                self._sequence += 1
                self._sock.send(_HEADER.pack(_HEADER.size + len(body), _SOCK_DIAG_BY_FAMILY,
                                             _NLM_F_REQUEST, self._sequence, 0) + body)
                while True:
                    reply = self._sock.recv(4096)
                    if len(reply) >= _HEADER.size and \
                            _HEADER.unpack_from(reply)[3] == self._sequence:
                        break  # an answer to an earlier, timed-out question is skipped
            except OSError:
                self.close_locked()
                return None
        kind = _HEADER.unpack_from(reply)[1]
        if kind == _NLMSG_ERROR or len(reply) < _UID_OFFSET + 4:
            return None
        return int(struct.unpack_from("=I", reply, _UID_OFFSET)[0])

    def close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _address(family: int, host: str) -> bytes:
    """An address as the socket id holds it: network order, padded to 16 bytes."""
    packed = socket.inet_pton(family, host.split("%", 1)[0])
    return packed + bytes(16 - len(packed))
