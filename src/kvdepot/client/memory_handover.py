"""The worker's side of the handover socket (`kvdepot.server.handover`): send the
registration's shared-memory file descriptors to the server, get a one-time ticket."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import msgspec

from kvdepot.errors import AuthenticationFailed, InvalidRequest, ServerUnavailable
from kvdepot.protocol import ENCODER, HandoverReply, HandoverRequest, SharedCPUMemory
from kvdepot.rpc.credentials import Credential

MAX_FDS = 253
"""Linux's SCM_MAX_FD: the most descriptors one message can carry."""
_DECODER = msgspec.msgpack.Decoder(HandoverReply)


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


def hand_over(address: str, credential: Credential | None, fds: list[int],
              timeout: float) -> bytes:
    """Send `fds` to the server listening at `address`; returns the ticket that names them
    in REGISTER_KV_CACHE."""
    if len(fds) > MAX_FDS:
        raise InvalidRequest(f"the KV cache spans {len(fds)} shared-memory files; one "
                             f"registration can hand over at most {MAX_FDS}")
    request = HandoverRequest(name=credential.name if credential else "",
                              token=credential.token if credential else "")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(timeout)
            sock.connect(socket_address(address))
            socket.send_fds(sock, [ENCODER.encode(request)], fds)
            data = sock.recv(4096)
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
