"""Waiting for something a server or an engine does on its own time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], what: str = "the condition",
               timeout: float = 60.0) -> None:
    """Poll `predicate` until it holds; fail the test, naming `what`, after `timeout`
    seconds (a guard against hanging, not a performance assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.02)
