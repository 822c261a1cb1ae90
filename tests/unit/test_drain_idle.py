"""The drain's wait for retrieves that lookups promised: counted from the drain's start,
the last transfer or the last request an engine sent, not from a transfer that ended
before the drain (the CI failure of stop 31: a retrieve made more than the idle time into
a drain, on a loaded machine, found the server gone)."""

from __future__ import annotations

import pytest

from kvdepot.server import drain as drain_module
from kvdepot.server.drain import DRAIN_IDLE, Drain


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(drain_module.time, "monotonic", clock)
    return clock


def test_a_promised_retrieve_is_awaited_for_the_idle_time_after_the_drain_starts(clock):
    owed = [1]
    drain = Drain(timeout=60, promised_reads=lambda: owed[0])
    drain.started()
    drain.finished()
    clock.now += 100  # the last transfer ended long before the signal
    drain.begin()
    assert not drain.is_over()
    clock.now += DRAIN_IDLE * 0.9
    assert not drain.is_over()
    drain.started()  # the promised retrieve arrives
    owed[0] = 0
    assert not drain.is_over()  # in flight
    drain.finished()
    assert drain.is_over()
    assert not drain.is_over()  # true once


def test_a_retrieve_that_never_comes_is_given_up_after_the_idle_time(clock):
    drain = Drain(timeout=60, promised_reads=lambda: 1)
    drain.begin()
    clock.now += DRAIN_IDLE - 0.01
    assert not drain.is_over()
    clock.now += 0.02
    assert drain.is_over()


def test_a_transfer_still_in_flight_holds_the_drain_until_the_deadline(clock):
    drain = Drain(timeout=60, promised_reads=lambda: 0)
    drain.started()
    drain.begin()
    clock.now += 59
    assert not drain.is_over()
    clock.now += 2
    assert drain.is_over()


def test_an_engine_still_sending_requests_keeps_the_wait_for_its_promise_open(clock):
    drain = Drain(timeout=60, promised_reads=lambda: 1)
    drain.begin()
    for _ in range(5):  # a lookup answered 0, a store refused, ... while the drain runs
        clock.now += DRAIN_IDLE * 0.9
        drain.heard()
        assert not drain.is_over()
    clock.now += DRAIN_IDLE
    assert drain.is_over()
