"""A handover peer's process held by a pidfd: which process it is, and proof of its exit,
whichever PID namespace it runs in.

The kernel hands the server a pidfd of the process that connected to a Unix socket
(`SO_PEERPIDFD`, Linux 6.5). Unlike a pid, a pidfd names one process for good: it is
never reused, it needs no /proc entry of that process (a process of another PID
namespace has none here, and its `SO_PEERCRED` pid reads as 0), and the kernel makes it
readable once the process has exited. So exit is proved without any pid, and nothing a
client says is taken for a process.
"""

from __future__ import annotations

import errno
import os
import select
import socket
from dataclasses import dataclass

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
"""Linux's option number (include/uapi/asm-generic/socket.h); Python 3.11 lacks the name."""
_UNSUPPORTED = (errno.ENOPROTOOPT, errno.EINVAL, errno.EOPNOTSUPP)
"""What getsockopt fails with on a kernel without SO_PEERPIDFD."""


class PeerExited(Exception):
    """The process that connected is gone already (proof: the kernel says so)."""


def peer_pidfd(conn: socket.socket) -> int | None:
    """A pidfd of the process that connected `conn` (the caller closes it); None if this
    kernel has no SO_PEERPIDFD.

    Raises PeerExited when the kernel reports that process gone, and OSError when the pidfd
    cannot be had now for another reason (no descriptor free): that proves nothing."""
    try:
        return conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return None
        if exc.errno == errno.ESRCH:
            raise PeerExited from None
        raise


def pidfd_pid(pidfd: int) -> int:
    """The process's pid in this process's PID namespace, as /proc tells it: 0 when it runs
    in a namespace this one cannot see (a sibling, such as another container's), -1 once
    it has exited."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise OSError(errno.EINVAL, f"descriptor {pidfd} is not a pidfd")


def _exited(pidfd: int) -> bool:
    """Whether the kernel reports the process gone: a pidfd polls readable from its exit
    on (a zombie counts as exited)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return any(mask & (select.POLLIN | select.POLLHUP) for _, mask in poller.poll(0))


@dataclass(eq=False)
class PidfdProcess:
    """A worker's process held by a pidfd (owned here: `close` closes it)."""

    fd: int
    pid: int
    """Its pid in the server's PID namespace; 0 when it runs in another one."""

    @classmethod
    def of(cls, fd: int) -> PidfdProcess:
        """Take ownership of `fd`; raises PeerExited (the fd closed) if the process is gone
        already."""
        try:
            pid = pidfd_pid(fd)
        except BaseException:
            os.close(fd)
            raise
        if pid < 0 or _exited(fd):
            os.close(fd)
            raise PeerExited
        return cls(fd, pid)

    def alive(self) -> bool:
        """False only on proof of exit (the kernel's): a pidfd keeps naming its process
        however long it is held, so there is no pid that could be reused in between."""
        if self.fd < 0:
            return False
        try:
            return not _exited(self.fd)
        except OSError:
            return True  # no proof either way: asked again at the next scan

    def same_process(self, other: object) -> bool:
        """Whether `other` holds the same process: pidfds on pidfs (Linux 6.9) have one
        inode per process; on older kernels every pidfd shares one, so only the same
        object counts."""
        if other is self:
            return True
        if not isinstance(other, PidfdProcess) or self.fd < 0 or other.fd < 0:
            return False
        mine, theirs = os.fstat(self.fd), os.fstat(other.fd)
        return _ON_PIDFS and (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _pidfs() -> bool:
    """Whether pidfds live on pidfs (an inode per process) rather than on the anonymous
    inode file system, where every eventfd and (before Linux 6.9) every pidfd lives."""
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        pidfd = os.pidfd_open(os.getpid())
    except OSError:
        return False
    anonymous = os.eventfd(0)
    try:
        return os.fstat(pidfd).st_dev != os.fstat(anonymous).st_dev
    finally:
        os.close(pidfd)
        os.close(anonymous)


_ON_PIDFS = _pidfs()
