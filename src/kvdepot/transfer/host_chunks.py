"""The chunk buffers of one copy operation in the page-locked pool, and the DMAs that
move them.

The CPU tier carves a store's chunks out of one pool, usually back to back, and a
retrieve reads them back in the same order. Where the byte ranges of consecutive chunks
follow each other in that pool, they cross PCIe as one DMA instead of one per chunk: with
several engines at once the server is bound by the CUDA calls it makes per operation
(docs/benchmarks.md), and a DMA per chunk was the largest share of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

Range = tuple[int, int, int, int, int]
"""(chunk, byte offset in its buffer, bytes, first block, end block), as
`CopyPlan.chunk_ranges` gives them."""


class HostChunks:
    """An operation's chunk buffers for one KV cache group: `length` bytes at each of
    `offsets` in `pool` (a flat uint8 tensor), in chunk order."""

    def __init__(self, pool: torch.Tensor, offsets: Sequence[int], length: int) -> None:
        self._pool = pool
        self._at = list(offsets)
        self.each = [pool[at:at + length] for at in self._at]
        """Each chunk's buffer, as a tensor."""

    def addresses(self, chunk: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """The address of byte `offset[i]` of chunk `chunk[i]`, for every i (uint64)."""
        starts = np.asarray(self._at, dtype=np.uint64) + np.uint64(self._pool.data_ptr())
        return starts[chunk] + offset.astype(np.uint64)

    def dma_runs(self, ranges: Sequence[Range]) -> list[tuple[torch.Tensor, int]]:
        """(host bytes, first block) per DMA for consecutive `ranges` (whose blocks, and so
        whose staging bytes, follow each other): ranges whose host bytes also follow each
        other are joined into one."""
        runs: list[list[int]] = []  # [start, end, first block]
        for chunk, offset, nbytes, block, _ in ranges:
            start = self._at[chunk] + offset
            if runs and runs[-1][1] == start:
                runs[-1][1] = start + nbytes
            else:
                runs.append([start, start + nbytes, block])
        return [(self._pool[start:end], block) for start, end, block in runs]
