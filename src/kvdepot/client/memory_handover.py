"""The worker's side of the handover socket (`kvdepot.server.handover`): send the
registration's shared-memory file descriptors to the server, get a one-time ticket.

The socket's abstract name comes in the server's PING reply, with the server's pid and
uid; all three arrive over the authenticated ZeroMQ connection. Abstract names are
listed in /proc/net/unix and anyone may bind a name its server no longer holds, so the
worker asks the kernel who listens on the socket it reached (SO_PEERCRED) and sends
nothing, no token and no descriptor, unless it is that very server process.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass, field

import msgspec

from kvdepot.errors import AuthenticationFailed, InvalidRequest, KVDepotError, ServerUnavailable
from kvdepot.protocol import ENCODER, HandoverReply, HandoverRequest, Pong, SharedCPUMemory
from kvdepot.rpc.credentials import Credential

MAX_FDS = 253
"""Linux's SCM_MAX_FD: the most descriptors one message can carry."""
_DECODER = msgspec.msgpack.Decoder(HandoverReply)
_PEERCRED = struct.Struct("3i")
"""struct ucred: pid, uid, gid."""


@dataclass
class HandoverFiles:
    """The descriptors one registration hands over (KV memory, and any other shared file
    it names); each `SharedCPUMemory` names its descriptor by index."""

    fds: list[int] = field(default_factory=list)
    owned: list[int] = field(default_factory=list)
    """The descriptors `close` closes (the KV memfds; a fence closes its own)."""

    def add(self, fd: int, nbytes: int, owned: bool = False) -> SharedCPUMemory:
        self.fds.append(fd)
        if owned:
            self.owned.append(fd)
        return SharedCPUMemory(fd_index=len(self.fds) - 1, nbytes=nbytes)

    def close(self) -> None:
        """Close the owned descriptors (the memory stays mapped where it is mapped)."""
        for fd in self.owned:
            os.close(fd)
        self.owned.clear()
        self.fds.clear()


def socket_address(address: str) -> str:
    """'@name' is an abstract socket (leading NUL), anything else a path."""
    return "\0" + address[1:] if address.startswith("@") else address


def check_handover_peer(sock: socket.socket, server: Pong) -> None:
    """Raise AuthenticationFailed unless the process listening on the connected `sock` is
    the server that sent `server` (its pid and uid, as the kernel reports them)."""
    pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   _PEERCRED.size))
    if (pid, uid) != (server.pid, server.uid):
        raise AuthenticationFailed(
            f"the handover socket {server.handover!r} is held by pid {pid} (uid {uid}), not by "
            f"the kvdepot server that answered over the authenticated connection (pid "
            f"{server.pid}, uid {server.uid}): sent it nothing")


def hand_over(server: Pong, credential: Credential | None, fds: list[int],
              timeout: float) -> bytes:
    """Send `fds` to the handover socket `server` (a PING reply over the authenticated
    connection) names, once the kernel confirms that the server process holds it;
    returns the ticket that names them in REGISTER_KV_CACHE."""
    if len(fds) > MAX_FDS:
        raise InvalidRequest(f"the KV cache spans {len(fds)} shared-memory files; one "
                             f"registration can hand over at most {MAX_FDS}")
    sends_token = credential is not None and credential.sends_secrets
    request = HandoverRequest(name=credential.name if credential else "",
                              token=credential.token if credential and sends_token else "")
    address = server.handover
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(timeout)
            sock.connect(socket_address(address))
            check_handover_peer(sock, server)
            socket.send_fds(sock, [ENCODER.encode(request)], fds)
            data = sock.recv(4096)
    except KVDepotError:  # a ConnectionError (so an OSError) too: keep its own message
        raise
    except OSError as exc:
        raise ServerUnavailable(f"cannot hand the KV memory to the kvdepot server at "
                                f"{address!r}: {exc}; the server must run on this host, in "
                                "this network namespace") from None
    try:
        reply = _DECODER.decode(data)
    except msgspec.DecodeError:
        raise ServerUnavailable("the kvdepot handover socket closed without a reply") from None
    if reply.error:
        if "refused" in reply.error:
            raise AuthenticationFailed(f"the kvdepot server refused the memory handover: "
                                       f"{reply.error}")
        raise InvalidRequest(f"the kvdepot server refused the memory handover: {reply.error}")
    return reply.ticket
