"""The CPU copier: every KV cache group of an operation in one call, over extents of the
pool; and an engine may unregister (or be reaped) on another thread while one of its
copies runs: the copy must neither fail with an internal error nor touch freed memory."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvdepot.errors import NotRegistered
from kvdepot.protocol import LayerSpec
from kvdepot.transfer.cpu_copier import CPUCopier
from kvdepot.transfer.engine_layout import EngineLayout
from kvdepot.transfer.group_copy import GroupCopy, PoolExtents


class _PlanClosingMidway:
    """A copy plan of four 8-byte copies whose walk closes the copier after the first,
    as an unregister on another thread would."""

    def __init__(self, copier: CPUCopier) -> None:
        self.copier = copier

    def each_copy(self) -> Iterator[tuple[int, int, int, int, int]]:
        for i in range(4):
            yield 0, 8 * i, 0, 8 * i, 8
            self.copier.close()


def _one_chunk(plan: object, pool: np.ndarray) -> list[GroupCopy]:
    return [GroupCopy(plan, PoolExtents(pool, np.zeros(1, np.int64), 32))]  # type: ignore[arg-type]


def test_a_copy_running_when_the_engine_unregisters_completes():
    engine = np.arange(32, dtype=np.uint8)
    copier = CPUCopier([engine])
    pool = np.zeros(32, dtype=np.uint8)
    copier.gather(_one_chunk(_PlanClosingMidway(copier), pool))
    assert np.array_equal(pool, engine)


def test_a_copy_starting_after_unregister_is_refused():
    copier = CPUCopier([np.zeros(32, dtype=np.uint8)])
    copier.close()
    with pytest.raises(NotRegistered):
        copier.scatter(_one_chunk(_PlanClosingMidway(copier), np.zeros(32, dtype=np.uint8)))


def _layer(name: str, group: int) -> LayerSpec:
    """A `[blocks, 16 tokens, 4]` uint8 layer of 8 blocks, its own allocation per group."""
    return LayerSpec(name, group, "uint8", [8, 16, 4], [64, 4, 1], 0, 0, group=group)


def test_each_group_reads_and_writes_only_its_own_extents_of_the_pool():
    layout = EngineLayout([_layer("full", 0), _layer("window", 1)], [512, 512], 16)
    plans = [group.plan(np.array([3, 5]), 1) for group in layout.groups]
    assert [plan.group for plan in plans] == [0, 1]
    engine = [np.arange(512, dtype=np.uint8), (np.arange(512) * 7).astype(np.uint8)]
    pool = np.full(1024, 0xAB, dtype=np.uint8)
    # Two chunks of 64 bytes per group, each chunk's groups side by side, chunks apart.
    extents = [PoolExtents(pool, np.array([100, 400]) + 64 * g, 64) for g in range(2)]
    groups = [GroupCopy(plan, e) for plan, e in zip(plans, extents, strict=True)]
    CPUCopier(engine).gather(groups)
    for g in range(2):
        assert np.array_equal(pool[100 + 64 * g:164 + 64 * g], engine[g][3 * 64:4 * 64])
        assert np.array_equal(pool[400 + 64 * g:464 + 64 * g], engine[g][5 * 64:6 * 64])
    untouched = np.ones(1024, dtype=bool)
    untouched[100:228] = untouched[400:528] = False
    assert (pool[untouched] == 0xAB).all()

    back = [np.zeros(512, dtype=np.uint8) for _ in range(2)]
    CPUCopier(back).scatter(groups)
    for g in range(2):
        for block in (3, 5):
            assert np.array_equal(back[g][block * 64:(block + 1) * 64],
                                  engine[g][block * 64:(block + 1) * 64])
