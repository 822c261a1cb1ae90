"""A benchmark's helper processes, talked to in JSON lines over their stdin and stdout.

The parent side (`Child`) reads each child's lines on a thread of its own, so a wait for
a reply has a deadline and a child that exits (crash, kill, OOM) is noticed at once as
the end of its output, instead of a read that never returns. The child side
(`ParentChannel`) keeps the protocol on a private copy of stdout and points file
descriptor 1 at stderr, so nothing else the child prints (a library, a C extension) can
mix into the protocol.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any


class ChildFailed(RuntimeError):
    """A child exited, or did not answer in time."""


class Child:
    """`python -m MODULE ARGS...` with `env` added to this process's environment."""

    def __init__(self, label: str, module: str, args: list[str],
                 env: dict[str, str] | None = None) -> None:
        self.label = label
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, **(env or {})}, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"read-{label}")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # end of output: the child exited

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise ChildFailed(f"{self.label} exited ({self._exit_status()})") from None

    def receive(self, timeout: float) -> dict[str, Any]:
        """The child's next message; ChildFailed if it exits or says nothing for `timeout`
        seconds."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise ChildFailed(f"{self.label} did not answer within {timeout:.0f} s") from None
        if line is None:
            self._lines.put(None)  # every later receive sees the end too
            raise ChildFailed(f"{self.label} exited ({self._exit_status()})")
        return json.loads(line)

    def _exit_status(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "closed its output but still runs"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def stop(self, timeout: float = 30.0) -> None:
        """Ask it to exit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.send({"do": "exit"})
                self.proc.wait(timeout=timeout)
            except (ChildFailed, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout)  # it has read to the end: its stream can close
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def send_all(children: list[Child], message: dict[str, Any]) -> None:
    for child in children:
        child.send(message)


def receive_all(children: list[Child], timeout: float) -> list[dict[str, Any]]:
    """One message from each child, all within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    return [child.receive(max(0.1, deadline - time.monotonic())) for child in children]


class ParentChannel:
    """The child side: messages from the parent on stdin, replies on the real stdout."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def send(self, message: dict[str, Any]) -> None:
        self._out.write(json.dumps(message) + "\n")
        self._out.flush()

    def receive(self) -> dict[str, Any] | None:
        """The parent's next message; None once the parent has closed stdin (it exited)."""
        line = sys.stdin.readline()
        return json.loads(line) if line else None
