"""Copies between engine CPU memory (shared with the server) and chunk buffers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvdepot.errors import NotRegistered
from kvdepot.transfer.group_copy import GroupCopy
from kvdepot.transfer.layout import CopyPlan


def copy_blocks(engine: Sequence[np.ndarray], plan: CopyPlan, chunks: Sequence[np.ndarray],
                to_host: bool) -> None:
    """Engine blocks -> chunk buffers (`to_host`, a store) or back (a retrieve), one
    memcpy per merged copy of `plan` (numpy slice assignment releases the GIL)."""
    for a, e, c, w, n in plan.each_copy():
        if to_host:
            chunks[c][w:w + n] = engine[a][e:e + n]
        else:
            engine[a][e:e + n] = chunks[c][w:w + n]


class CPUCopier:
    """The `Copier` of a CPU registration: `copy_blocks` for each group of an operation.

    `close` may come from another thread while a copy runs (the engine unregisters, or
    is reaped): a running copy finishes on the arrays it started with, which keep the
    mapping alive until it ends; a copy that starts afterwards is refused."""

    def __init__(self, allocations: Sequence[np.ndarray]) -> None:
        self.allocations = list(allocations)

    def _engine(self) -> list[np.ndarray]:
        engine = self.allocations  # this list is never changed, only replaced
        if not engine:
            raise NotRegistered("the engine unregistered before this operation's copies began")
        return engine

    def gather(self, groups: Sequence[GroupCopy], event_handle: bytes | None = None) -> None:
        """Engine blocks -> the pool (a store). CPU engines pass no event: their KV is
        complete when they submit."""
        engine = self._engine()
        for group in groups:
            copy_blocks(engine, group.plan, group.extents.views(), to_host=True)

    def scatter(self, groups: Sequence[GroupCopy], event_handle: bytes | None = None) -> None:
        """The pool -> engine blocks (a retrieve)."""
        engine = self._engine()
        for group in groups:
            copy_blocks(engine, group.plan, group.extents.views(), to_host=False)

    def close(self) -> None:
        self.allocations = []
