"""Copies between engine CPU memory (shared with the server) and chunk buffers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvdepot.errors import NotRegistered
from kvdepot.transfer.layout import CopyPlan


class CPUCopier:
    """Runs copy plans with plain memcpy (numpy slice assignment releases the GIL).

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

    def gather(self, plan: CopyPlan, chunks: Sequence[np.ndarray],
               event_handle: bytes | None = None) -> None:
        """Engine blocks -> chunk buffers (a store). CPU engines pass no event: their KV
        is complete when they submit."""
        engine = self._engine()
        for a, e, c, w, n in plan.each_copy():
            chunks[c][w:w + n] = engine[a][e:e + n]

    def scatter(self, plan: CopyPlan, chunks: Sequence[np.ndarray],
                event_handle: bytes | None = None) -> None:
        """Chunk buffers -> engine blocks (a retrieve)."""
        engine = self._engine()
        for a, e, c, w, n in plan.each_copy():
            engine[a][e:e + n] = chunks[c][w:w + n]

    def close(self) -> None:
        self.allocations = []
