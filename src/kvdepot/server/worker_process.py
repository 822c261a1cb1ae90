"""Which process a worker is, so that the server can tell when it has died.

A pid alone is not enough: pids are reused. The kernel's start time of the process
(field 22 of /proc/PID/stat) tells a reused pid from the worker. The process is taken
from the handover socket's peer credentials, while the worker is connected, never from
what a client claims.

Only proof counts as death: /proc/PID missing (ENOENT, or ESRCH while it is torn down),
another start time (the pid was reused), or a zombie. Anything else that stops the
server from reading /proc (it has no free descriptor, EMFILE; the system has none,
ENFILE; a transient ENOMEM) tells nothing about the worker: an engine whose registration
were dropped for it would fail every store with NotRegistered while it is running (an
unauthenticated flood of connections exhausted the server's descriptors and did exactly
that). When /proc cannot be read, `kill(pid, 0)`, which needs no descriptor, still
proves death by ESRCH; otherwise the worker counts as alive until the next check.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

_GONE = (errno.ENOENT, errno.ESRCH)
"""What opening or reading /proc/PID/stat fails with once the process is gone (ESRCH
when it exits while being read)."""


def process_start(pid: int) -> int | None:
    """The start time of process `pid` as /proc tells it; None on proof that there is
    none (no such pid here, or a zombie: exited, not yet waited for).

    Raises OSError when /proc cannot be read for any other reason: that proves nothing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise
    # Fields after the command name (which may hold spaces): state first, start time 20th.
    fields = stat[stat.rindex(b")") + 2:].split()
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def _pid_exists(pid: int) -> bool:
    """Whether any process has `pid`, asked without a descriptor (kill with signal 0)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


@dataclass(frozen=True)
class WorkerProcess:
    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> WorkerProcess | None:
        """Process `pid` as it is now; None if it cannot be watched from here (a worker in
        another pid namespace usually has no such pid here, and is then never reaped).

        Raises OSError when /proc cannot be read now (e.g. the server is out of
        descriptors): the caller refuses for now rather than register a worker it
        could never reap."""
        start = process_start(pid) if pid > 0 else None
        return None if start is None else cls(pid, start)

    def alive(self) -> bool:
        """False only on proof that the worker is gone; True while that is unknown."""
        try:
            return process_start(self.pid) == self.start
        except OSError:
            # No proof either way from /proc (EMFILE, ENFILE, ENOMEM, ...): a pid nobody
            # has is still proof, and a pid somebody has is taken as the worker's until
            # /proc can tell the start time again.
            return _pid_exists(self.pid)
