"""Which process a worker is, so that the server can tell when it has died.

A pid alone is not enough: pids are reused. The kernel's start time of the process
(field 22 of /proc/PID/stat) tells a reused pid from the worker. The process is taken
from the handover socket's peer credentials, while the worker is connected, never from
what a client claims.
"""

from __future__ import annotations

from dataclasses import dataclass


def process_start(pid: int) -> int | None:
    """The start time of process `pid` as /proc tells it; None if there is none (no such
    pid here, or a zombie: exited, not yet waited for)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces): state first, start time 20th.
    fields = stat[stat.rindex(b")") + 2:].split()
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


@dataclass(frozen=True)
class WorkerProcess:
    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> WorkerProcess | None:
        """Process `pid` as it is now; None if it cannot be watched from here (a worker in
        another pid namespace usually has no such pid here, and is then never reaped)."""
        start = process_start(pid) if pid > 0 else None
        return None if start is None else cls(pid, start)

    def alive(self) -> bool:
        return process_start(self.pid) == self.start
