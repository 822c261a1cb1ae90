"""Deferred operations: every copy is waited for, even after one failed, and a completion
thread finishes them in order, turning failures into the reply."""

from __future__ import annotations

import threading

import pytest

from kvdepot.server.completions import Completer, Deferred


class Copy:
    finished = False

    def __init__(self, log: list[str], name: str, error: Exception | None = None) -> None:
        self.log, self.name, self.error = log, name, error

    def wait(self) -> None:
        self.log.append(self.name)
        if self.error is not None:
            raise self.error


def test_every_copy_is_waited_for_and_finish_gets_the_first_error():
    log: list[str] = []
    first, second = RuntimeError("first"), RuntimeError("second")
    seen: list[BaseException | None] = []

    def finish(error: BaseException | None) -> str:
        seen.append(error)
        return "finished"

    deferred = Deferred([Copy(log, "a", first), Copy(log, "b", second), Copy(log, "c")],
                        finish)
    assert deferred.complete() == "finished"
    assert log == ["a", "b", "c"] and seen == [first]


def test_a_completer_settles_in_order_and_passes_failures_on():
    settled: list[object] = []
    done = threading.Event()
    completer = Completer("test-completer")

    def failing(error: BaseException | None) -> str:
        raise ValueError("finish failed")

    for i in range(5):
        completer.add(Deferred([Copy([], str(i))], lambda _, i=i: i), settled.append)
    completer.add(Deferred([Copy([], "x")], failing), settled.append)
    completer.add(Deferred([], lambda _: "last"), lambda outcome: (settled.append(outcome),
                                                                   done.set()))
    assert done.wait(10)
    completer.close()
    assert settled[:5] == [0, 1, 2, 3, 4] and settled[6] == "last"
    assert isinstance(settled[5], ValueError)


def test_close_finishes_what_was_added_first():
    settled: list[object] = []
    completer = Completer("test-completer")
    gate = threading.Event()

    class Slow:
        finished = False

        def wait(self) -> None:
            assert gate.wait(10)

    completer.add(Deferred([Slow()], lambda _: "slow"), settled.append)
    threading.Timer(0.2, gate.set).start()
    completer.close()
    assert settled == ["slow"]


@pytest.mark.parametrize("finished", [True, False])
def test_copies_known_to_be_over_finish_inline(finished):
    from kvdepot.server.data_path import DataPath

    copy = Copy([], "a")
    copy.finished = finished
    outcome = DataPath._settled([copy], lambda error: "reply")
    assert (outcome == "reply") if finished else isinstance(outcome, Deferred)
