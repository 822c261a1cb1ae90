"""Running a test's attacker as another local user, through setpriv(1).

The tests run as root in CI; an attacker started this way has exactly an unprivileged
user's rights from its first instruction (no capabilities, no supplementary groups).
Run by anyone else, the attacker would keep the tests' own uid and prove nothing about
another user, so a test that needs one is skipped, saying why."""

from __future__ import annotations

import os
import sys

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
