"""The worker's side of the handover socket (`kvdepot.server.handover`): send the
registration's shared-memory file descriptors to the server, get a one-time ticket.

The socket's abstract name comes in the server's PING reply, with the server's pid and
uid; all three arrive over the authenticated ZeroMQ connection. Abstract names are
listed in /proc/net/unix and anyone may bind a name its server no longer holds, so the
worker asks the kernel who listens on the socket it reached (SO_PEERCRED) and sends
nothing, no token and no descriptor, unless it is that very server process.

A worker of another network namespace (a container) cannot reach an abstract name: it
hands over through the socket at a path in the server's socket directory, which it
finds from its ipc:// URL or `$KVDEPOT_SOCKET_DIR`. A server of another PID namespace
has no pid here (SO_PEERCRED reads 0), so there the worker trusts the path instead:
the directory and the socket must belong to the server's uid, and the directory be
writable by nobody else, so no other user could have put a socket there.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlparse

import msgspec

from kvdepot.errors import AuthenticationFailed, InvalidRequest, KVDepotError, ServerUnavailable
from kvdepot.protocol import ENCODER, HandoverReply, HandoverRequest, Pong, SharedCPUMemory
from kvdepot.rpc.credentials import Credential

MAX_FDS = 253
"""Linux's SCM_MAX_FD: the most descriptors one message can carry."""
_DECODER = msgspec.msgpack.Decoder(HandoverReply)
_PEERCRED = struct.Struct("3i")
"""struct ucred: pid, uid, gid."""
SOCKET_DIR_ENV = "KVDEPOT_SOCKET_DIR"
"""Where this process sees the server's socket directory, when its URL is not an ipc://
path in it (an engine that reaches the server over TCP)."""


class Handed(NamedTuple):
    """What the server answered a handover: the ticket, and the pid to claim with it."""

    ticket: bytes
    pid: int


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


def socket_dir_of(url: str) -> Path | None:
    """Where this process sees the server's socket directory: `$KVDEPOT_SOCKET_DIR`, else
    the directory of an ipc:// `url`; None when neither says."""
    named = os.environ.get(SOCKET_DIR_ENV)
    if named:
        return Path(named)
    parsed = urlparse(url)
    if parsed.scheme == "ipc":
        return Path(url[len("ipc://"):]).parent
    return None


def handover_address(server: Pong, url: str) -> str:
    """The socket to hand over to: the path in the socket directory when the server has
    one and this process knows where it sees it, else the abstract name (which only a
    process of the server's network namespace reaches)."""
    directory = socket_dir_of(url)
    if server.handover_path and directory is not None:
        return str(directory / server.handover_path)
    return server.handover


def _check_path_owner(address: str, uid: int) -> None:
    """Raise AuthenticationFailed unless socket `address` and its directory belong to `uid`
    and nobody else may write the directory: then no other user put the socket there."""
    path = Path(address)
    try:
        directory, entry = os.stat(path.parent), os.lstat(path)
    except OSError as exc:
        raise AuthenticationFailed(f"cannot check the handover socket {address}: {exc}"
                                   ) from None
    mode = stat.S_IMODE(directory.st_mode)
    if directory.st_uid != uid or entry.st_uid != uid or mode & 0o022:
        raise AuthenticationFailed(
            f"the handover socket {address} (uid {entry.st_uid}) in {path.parent} (uid "
            f"{directory.st_uid}, mode {mode:04o}) could have been put there by another user "
            f"than the kvdepot server's (uid {uid}): sent it nothing")


def check_handover_peer(sock: socket.socket, server: Pong, address: str | None = None
                        ) -> None:
    """Raise AuthenticationFailed unless the process listening on the connected `sock` is
    the server that sent `server`: its pid and uid as the kernel reports them, or, for a
    server of another PID namespace (whose pid reads 0 here), its uid and a socket `address`
    at a path only that uid could have created."""
    pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   _PEERCRED.size))
    address = address or server.handover
    if pid == 0 and uid == server.uid and not address.startswith("@"):
        _check_path_owner(address, uid)
        return
    if (pid, uid) != (server.pid, server.uid):
        raise AuthenticationFailed(
            f"the handover socket {address!r} is held by pid {pid} (uid {uid}), not by "
            f"the kvdepot server that answered over the authenticated connection (pid "
            f"{server.pid}, uid {server.uid}): sent it nothing")


def hand_over(server: Pong, credential: Credential | None, fds: list[int],
              timeout: float) -> bytes:
    """`hand_over_to` in the server's namespaces (its abstract socket): the ticket only."""
    return hand_over_to(server, credential, fds, timeout).ticket


def hand_over_to(server: Pong, credential: Credential | None, fds: list[int],
                 timeout: float, url: str = "") -> Handed:
    """Send `fds` to the handover socket `server` (a PING reply over the authenticated
    connection to `url`) names, once the kernel confirms that the server process holds
    it; returns the ticket that names them in REGISTER_KV_CACHE and the pid to claim."""
    if len(fds) > MAX_FDS:
        raise InvalidRequest(f"the KV cache spans {len(fds)} shared-memory files; one "
                             f"registration can hand over at most {MAX_FDS}")
    sends_token = credential is not None and credential.sends_secrets
    request = HandoverRequest(name=credential.name if credential else "",
                              token=credential.token if credential and sends_token else "")
    address = handover_address(server, url)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(timeout)
            sock.connect(socket_address(address))
            check_handover_peer(sock, server, address)
            socket.send_fds(sock, [ENCODER.encode(request)], fds)
            data = sock.recv(4096)
    except KVDepotError:  # a ConnectionError (so an OSError) too: keep its own message
        raise
    except OSError as exc:
        raise ServerUnavailable(f"cannot hand the KV memory to the kvdepot server at "
                                f"{address!r}: {exc}; the server must run on this host, in "
                                "this network namespace, or share its socket directory "
                                f"(an ipc:// URL in it, or ${SOCKET_DIR_ENV})") from None
    try:
        reply = _DECODER.decode(data)
    except msgspec.DecodeError:
        raise ServerUnavailable("the kvdepot handover socket closed without a reply") from None
    if reply.error:
        if "refused" in reply.error:
            raise AuthenticationFailed(f"the kvdepot server refused the memory handover: "
                                       f"{reply.error}")
        raise InvalidRequest(f"the kvdepot server refused the memory handover: {reply.error}")
    return Handed(reply.ticket, reply.pid)
