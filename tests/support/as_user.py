"""Running a test's attacker as another local user, through setpriv(1).

The tests run as root in CI; an attacker started this way has exactly an unprivileged
user's rights from its first instruction (no capabilities, no supplementary groups).
Run by anyone else, the attacker would keep the tests' own uid and prove nothing about
another user, so a test that needs one is skipped, saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

NOBODY = 65534


def as_user(*command: str, uid: int = NOBODY) -> list[str]:
    """`command` run as `uid` (its own group too), for subprocess."""
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root (setpriv); the tests run as root in "
                    "CI. Run as this user, the attacker would keep the server's uid")
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *command]


def python_as_user(module: str, *args: str, uid: int = NOBODY) -> list[str]:
    """`python -m module args...` as `uid`."""
    return as_user(sys.executable, "-m", module, *args, uid=uid)


class AttackerProcess:
    """A test's attacker child (a `python_as_user` command): it answers each line it reads
    on stdin with one JSON line, and a closed stdin ends it. `report_command` is the line
    that asks it how its connections fared."""

    report_command = "report"

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the attacker exited (status {self.proc.wait(10)})"
        return json.loads(line)

    def report(self) -> dict[str, Any]:
        """At least {"closed": how many of its connections the server has ended so far,
        "longest": the longest any of those lived, in seconds}."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(self.report_command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def closed(self) -> int:
        return int(self.report()["closed"])

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
