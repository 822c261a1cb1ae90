"""How a copy process's waiter decides that a request's copies are done: a retrieve's by
asking its events (an engine waits for that reply), a store's by sleeping on them."""

from __future__ import annotations

import socket

import pytest

from kvdepot.transfer.copy_process import wire
from kvdepot.transfer.copy_process.main import RETRIEVE_POLL_SECONDS, _wait_and_reply

pytestmark = pytest.mark.timeout(30)


class CompletesAfter:
    """Stands in for a torch.cuda.Event (no GPU here) that completes at the `polls`th
    query; records the order of the calls made on it."""

    def __init__(self, polls: int) -> None:
        self.polls = polls
        self.calls: list[str] = []

    def query(self) -> bool:
        self.calls.append("query")
        return self.calls.count("query") >= self.polls

    def synchronize(self) -> None:
        self.calls.append("synchronize")


def reply_to(done: list[CompletesAfter], poll_seconds: float | None) -> wire.Outcome:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        _wait_and_reply(ours, done, poll_seconds)  # type: ignore[arg-type]
        return wire.OUTCOMES.decode(wire.receive(theirs, wire.MAX_REPLY_BYTES))


def test_a_retrieves_waiter_asks_until_each_event_is_done_then_replies() -> None:
    done = [CompletesAfter(5), CompletesAfter(1)]
    outcome = reply_to(done, RETRIEVE_POLL_SECONDS)
    assert outcome.error_kind == 0
    assert done[0].calls == ["query"] * 5 + ["synchronize"]
    assert done[1].calls == ["query", "synchronize"]


def test_a_stores_waiter_sleeps_on_its_events() -> None:
    done = [CompletesAfter(5)]
    outcome = reply_to(done, None)
    assert outcome.error_kind == 0
    assert done[0].calls == ["synchronize"]
