"""A `kvdepot serve` child process, for the tests and the benchmarks.

It runs the real command line (`python -m kvdepot.cli serve ...`), so whatever a test or
a benchmark measures is the server a user starts.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Literal

from kvdepot.client.admin import AdminClient
from kvdepot.errors import ServerUnavailable
from kvdepot.rpc.connection import wait_for_server

_handed_out: set[int] = set()
_pick = random.Random(os.getpid() ^ time.time_ns())


def _ephemeral_low() -> int | None:
    """The lowest port the kernel hands to outgoing connections (Linux), if known."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port() -> int:
    """A TCP port nothing is bound to right now, for a listener started soon after.

    Chosen below the kernel's ephemeral range where it can: a port from that range may be
    taken by any outgoing connection between this call and the listener's bind (a Redis
    cluster node failed to start that way in CI). Never the same port twice in one process,
    so several listeners picked before any starts do not collide."""
    low = _ephemeral_low()
    if low is not None and low > 2048:
        first = max(1024, low - 16384)
        for _ in range(200):
            port = _pick.randrange(first, low)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


def cpu_seconds(pid: int, children: bool = False) -> float:
    """User + system CPU time of process `pid` so far, all threads (Linux /proc); with
    `children`, also that of its child processes, running (the server's GPU copy
    processes) or exited and reaped."""
    fields = _stat_fields(pid)
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
        for child in child_pids(pid):
            try:
                fields = _stat_fields(child)
            except OSError:
                continue  # exited since
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[bytes]:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def child_pids(pid: int) -> set[int]:
    """The running child processes of `pid`."""
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return found


Output = Path | Literal["capture", "inherit"]


class ServerProcess:
    """`kvdepot serve` on 127.0.0.1; `start()` again after `kill()` restarts it on the
    same port. Unset options are the server's own defaults.

    `output`: "capture" keeps what the server prints for `stop()` to return, "inherit"
    lets it print to this process's terminal, a path appends it to that file.
    """

    def __init__(self, *, port: int | None = None, chunk_size: int | None = None,
                 l1_size: str | int | None = None, lock_ttl: float | None = None,
                 extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 output: Output = "capture") -> None:
        self.port = port or free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        options = {"--chunk-size": chunk_size, "--l1-size": l1_size, "--lock-ttl": lock_ttl}
        self.args = [sys.executable, "-m", "kvdepot.cli", "serve", "--port", str(self.port)]
        for flag, value in options.items():
            if value is not None:
                self.args += [flag, str(value)]
        self.args += extra
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.output = output
        self.proc: subprocess.Popen[bytes] | None = None
        self._capture: tempfile._TemporaryFileWrapper[bytes] | None = None
        """Where a captured server prints: a file, not a pipe, which nobody reads while
        the server runs and which would block a server that prints a lot."""

    def start(self, timeout: float = 120.0) -> ServerProcess:
        """Start the server and return once it answers a ping."""
        if isinstance(self.output, Path):
            with open(self.output, "ab") as log:
                self.proc = self._launch(log)
        elif self.output == "capture":
            if self._capture is not None:
                self._capture.close()
            self._capture = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives past start)
                prefix="kvdepot-serve-", suffix=".log")
            self.proc = self._launch(self._capture)
        else:
            self.proc = self._launch(None)
        try:
            wait_for_server(self.url, timeout, self.proc)
        except ServerUnavailable as exc:
            printed = self.stop()
            where = f"; see {self.output}" if isinstance(self.output, Path) else ""
            raise ServerUnavailable(f"kvdepot serve did not start: {exc}{where}\n"
                                    f"{printed[-2000:]}") from None
        return self

    def _launch(self, output: IO[bytes] | None) -> subprocess.Popen[bytes]:
        """Run `self.args`, printing to `output` (a file) or, if None, this terminal."""
        if output is None:
            return subprocess.Popen(self.args, env=self.env)
        return subprocess.Popen(self.args, env=self.env, stdout=output, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the server was never started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_seconds(self) -> float:
        """The server's CPU time so far, its GPU copy processes' included."""
        return cpu_seconds(self.pid, children=True)

    def stats(self) -> dict[str, float]:
        with AdminClient(self.url) as admin:
            return admin.stats()

    def clear(self) -> int:
        with AdminClient(self.url) as admin:
            return admin.clear()

    def kill(self) -> None:
        """SIGKILL: the server vanishes without a goodbye, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> str:
        """SIGTERM and wait; returns what the server printed if it was captured."""
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._capture is None:
            return ""
        self._capture.seek(0)
        return self._capture.read().decode(errors="replace")

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
