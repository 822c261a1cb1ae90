"""An engine may unregister (or be reaped) on another thread while one of its copies
runs; the copy must neither fail with an internal error nor touch freed memory."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvdepot.errors import NotRegistered
from kvdepot.transfer.cpu_copier import CPUCopier


class _PlanClosingMidway:
    """A copy plan of four 8-byte copies whose walk closes the copier after the first,
    as an unregister on another thread would."""

    def __init__(self, copier: CPUCopier) -> None:
        self.copier = copier

    def each_copy(self) -> Iterator[tuple[int, int, int, int, int]]:
        for i in range(4):
            yield 0, 8 * i, 0, 8 * i, 8
            self.copier.close()


def test_a_copy_running_when_the_engine_unregisters_completes():
    engine = np.arange(32, dtype=np.uint8)
    copier = CPUCopier([engine])
    chunk = np.zeros(32, dtype=np.uint8)
    copier.gather(_PlanClosingMidway(copier), [chunk])  # type: ignore[arg-type]
    assert np.array_equal(chunk, engine)


def test_a_copy_starting_after_unregister_is_refused():
    copier = CPUCopier([np.zeros(32, dtype=np.uint8)])
    copier.close()
    with pytest.raises(NotRegistered):
        copier.scatter(_PlanClosingMidway(copier), [np.zeros(32, dtype=np.uint8)])  # type: ignore[arg-type]
