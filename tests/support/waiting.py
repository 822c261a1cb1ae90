"""Waiting for something a server or an engine does on its own time."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvdepot.client.admin import AdminClient


def wait_until(predicate: Callable[[], object], what: str = "the condition",
               timeout: float = 60.0, interval: float = 0.02) -> None:
    """Poll `predicate` every `interval` seconds until it holds; fail the test, naming
    `what`, after `timeout` seconds (a guard against hanging, not a performance
    assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(interval)


def wait_for_writes(url: str, n: int) -> None:
    """Until the server's write-behind has written `n` chunks to its lower tiers (it runs
    after the store's reply), over one admin connection."""
    deadline = time.monotonic() + 30
    with AdminClient(url) as admin:
        while admin.stats()["lower_tier_writes"] < n:
            assert time.monotonic() < deadline, "write-behind never finished"
            time.sleep(0.05)
