"""Catching a server in the middle of an operation's copies, by its fence locks.

The server runs every copy of a store or retrieve while it holds a POSIX record lock on
that operation's slot of the worker's fence file (kvdepot.transfer.fence), so /proc/locks
shows, from outside, whether it is copying and for which worker (the fence file's inode).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable


def server_locks(pid: int, inode: int | None = None) -> int:
    """POSIX record locks process `pid` holds (the fence slots it is copying under), only
    those on the file with inode `inode` if given."""
    held = 0
    with open("/proc/locks") as f:
        for line in f:
            # "1: POSIX  ADVISORY  WRITE 1234 00:01:5678 0 7"; blocked waiters have "->".
            fields = line.split()
            if fields[1:2] != ["POSIX"] or fields[4] != str(pid):
                continue
            if inode is None or fields[5].rsplit(":", 1)[1] == str(inode):
                held += 1
    return held


def stop_process(pid: int) -> None:
    """SIGSTOP, and return once the process is stopped (the signal is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    while True:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"T":
                return
        time.sleep(0.0005)


def stop_inside_copies(pid: int, still_copying: Callable[[], bool],
                       inode: int | None = None) -> bool:
    """Stop the server while it holds a fence slot lock (of the fence file `inode`, if
    given: one worker's operations), letting it run in short slices in between; False if
    it finished every copy first (`still_copying()` turned False). On True the server is
    left stopped: the caller continues it (SIGCONT). The server only advances while
    continued, for about a scheduler slice at a time, so copies that take many slices
    cannot start and end between two looks: no retry is needed."""
    while True:
        stop_process(pid)
        if server_locks(pid, inode):
            return True
        if not still_copying():  # asked while stopped: the slices stay short
            os.kill(pid, signal.SIGCONT)
            return False
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.0005)
