"""Copies between engine CPU memory (shared with the server) and chunk buffers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvdepot.transfer.layout import CopyPlan


class CPUCopier:
    """Runs copy plans with plain memcpy (numpy slice assignment releases the GIL)."""

    def __init__(self, allocations: Sequence[np.ndarray]) -> None:
        self.allocations = list(allocations)

    def gather(self, plan: CopyPlan, chunks: Sequence[np.ndarray],
               event_handle: bytes | None = None) -> None:
        """Engine blocks -> chunk buffers (a store). CPU engines pass no event: their KV
        is complete when they submit."""
        engine = self.allocations
        for a, e, c, w, n in plan.each_copy():
            chunks[c][w:w + n] = engine[a][e:e + n]

    def scatter(self, plan: CopyPlan, chunks: Sequence[np.ndarray],
                event_handle: bytes | None = None) -> None:
        """Chunk buffers -> engine blocks (a retrieve)."""
        engine = self.allocations
        for a, e, c, w, n in plan.each_copy():
            engine[a][e:e + n] = chunks[c][w:w + n]

    def close(self) -> None:
        self.allocations.clear()
