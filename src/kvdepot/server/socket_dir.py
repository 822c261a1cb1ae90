"""The socket directory (`--socket-dir`): the one thing the server shares with engines
that run in namespaces of their own (containers, pods).

It holds the ZeroMQ request socket (`ipc://DIR/kvdepot.sock`) and the handover socket
(`DIR/handover.sock`), both paths, because an abstract Unix socket exists only inside
one network namespace and a directory can be mounted into any container.

A socket at a path is only as trustworthy as the directory that holds it: whoever may
create entries there may put a socket of their own in place of the server's, and an
engine would hand its memory to it. So the server refuses, at start, a directory that
another uid owns or that anyone but its owner may write (as the disk tier refuses
another uid's directory), and engines check the same before they send anything.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
from pathlib import Path

log = logging.getLogger(__name__)

REQUEST_SOCKET = "kvdepot.sock"
HANDOVER_SOCKET = "handover.sock"


def check_private_to(path: Path, uid: int, info: os.stat_result) -> None:
    """Raise ValueError unless `path` (`info` its lstat) is a directory of `uid` that no
    other uid may write."""
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{path} is not a directory")
    if info.st_uid != uid:
        raise ValueError(f"{path} belongs to uid {info.st_uid}, not to uid {uid}: another "
                         "user could replace the sockets in it; give the directory to the "
                         "server's user")
    if stat.S_IMODE(info.st_mode) & 0o022:
        raise ValueError(f"{path} is writable by others (mode "
                         f"{stat.S_IMODE(info.st_mode):04o}): another user could replace the "
                         "sockets in it; make it 0755 or 0711")


class SocketDir:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Create the directory (0755) or check an existing one (its owner and its mode;
        a link is refused: what it points to could change under the server)."""
        self.path = Path(os.path.abspath(path))
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.path, 0o755)
        info = os.lstat(self.path)
        check_private_to(self.path, os.geteuid(), info)
        self._identity = (info.st_dev, info.st_ino)
        self._sockets: dict[str, tuple[int, int]] = {}
        """Each socket made connectable here, by the identity of its file."""
        self._missing = False

    @property
    def request_url(self) -> str:
        return f"ipc://{self.path / REQUEST_SOCKET}"

    def claim(self, name: str, kind: socket.SocketKind = socket.SOCK_SEQPACKET) -> Path:
        """The path for a socket named `name` (of type `kind`), free to bind: a socket left
        by a server that is gone is removed; one a live server listens on is refused."""
        path = self.path / name
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return path
        if not stat.S_ISSOCK(info.st_mode):
            raise ValueError(f"{path} exists and is not a socket; remove it")
        with socket.socket(socket.AF_UNIX, kind) as probe:
            try:
                probe.connect(str(path))
            except OSError as exc:
                if exc.errno != errno.ECONNREFUSED:
                    raise ValueError(f"cannot tell whether a server listens on {path}: {exc}"
                                     ) from None
            else:
                raise ValueError(f"another server listens on {path}: give each server a "
                                 "socket directory of its own")
        os.unlink(path)
        return path

    def make_connectable(self, name: str) -> None:
        """Let every uid that reaches the directory connect to socket `name` (connecting
        to a Unix socket needs write access to its file): CURVE and the handover's token
        decide who is served, not the file's mode."""
        os.chmod(self.path / name, 0o666)
        info = os.lstat(self.path / name)
        self._sockets[name] = (info.st_dev, info.st_ino)

    def check_still_there(self) -> bool:
        """Whether the directory is still the one the server started with; says so in the
        log once when it is gone (or replaced) and once when it is back. Connections
        already open go on being served either way: only new ones need the paths."""
        present = self._same(self.path, self._identity) and all(
            self._same(self.path / name, identity) for name, identity in self._sockets.items())
        if not present and not self._missing:
            log.error("the socket directory %s was removed or replaced while serving: engines "
                      "cannot connect or hand over memory through it until the server "
                      "restarts; connections already open are still served", self.path)
        elif present and self._missing:
            log.warning("the socket directory %s is back", self.path)
        self._missing = not present
        return present

    @staticmethod
    def _same(path: Path, identity: tuple[int, int]) -> bool:
        """Whether `path` is still the file of `identity` and linked: where the directory is
        mounted in (a container's bind mount), a removed one stays reachable, unlinked."""
        try:
            info = os.lstat(path)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == identity and info.st_nlink > 0
