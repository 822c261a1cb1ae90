"""The chunk buffers of one copy operation, and the DMAs that move them.

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
    """Per chunk, its buffer as a tensor; and, when every buffer is a view of the same
    flat byte array, that array as a tensor with each buffer's offset in it."""

    def __init__(self, chunks: Sequence[np.ndarray]) -> None:
        self.each = [torch.from_numpy(c) for c in chunks]
        self._whole: torch.Tensor | None = None
        self._at: list[int] = []
        base = chunks[0].base if len(chunks) > 1 else None
        if (isinstance(base, np.ndarray) and base.dtype == np.uint8 and base.ndim == 1
                and base.flags.c_contiguous and all(c.base is base for c in chunks)):
            origin = base.ctypes.data
            self._at = [c.ctypes.data - origin for c in chunks]
            self._whole = torch.from_numpy(base)

    def dma_runs(self, ranges: Sequence[Range]) -> list[tuple[torch.Tensor, int]]:
        """(host bytes, first block) per DMA for consecutive `ranges` (whose blocks, and so
        whose staging bytes, follow each other): ranges whose host bytes also follow each
        other are joined into one."""
        if self._whole is None:
            return [(self.each[c][o:o + n], block) for c, o, n, block, _ in ranges]
        runs: list[list[int]] = []  # [start, end, first block]
        for chunk, offset, nbytes, block, _ in ranges:
            start = self._at[chunk] + offset
            if runs and runs[-1][1] == start:
                runs[-1][1] = start + nbytes
            else:
                runs.append([start, start + nbytes, block])
        return [(self._whole[start:end], block) for start, end, block in runs]
