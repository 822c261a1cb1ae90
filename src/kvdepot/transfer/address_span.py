"""One tensor over every mapped engine allocation, so a copy plan is one indexed kernel.

An engine may hand over one allocation (vLLM's per-layer views into a shared buffer) or
dozens (one per layer). A gather or scatter kernel launched per allocation would cost a
launch per layer per chunk, so instead the server views the whole address range from
the lowest to the highest mapped byte as a single byte tensor and addresses every
segment as rows of it. Only rows inside real allocations are ever indexed; the gaps
between allocations are never touched.

The same plan is then cut into equal rows: the row size is the largest size dividing
every segment's length and both its offsets, so a FlashAttention plan moves 32 KiB rows
and its index holds one entry per 32 KiB, not per byte.

`BlockRows` does this once per registered layout instead of once per operation: a block's
rows are a fixed pattern shifted by the block id times the layer's block stride, so the
pattern lives on the GPU and an operation sends only its block ids (a few hundred bytes);
one broadcast add there expands them into the row index. Building that index on the
host (plan, offsets, row expansion, a page-locked copy of up to 100 KiB) cost about a
millisecond of the server's single Python thread per operation.
"""

from __future__ import annotations

import ctypes
from math import gcd

import numpy as np
import torch

from kvdepot.transfer.layout import BlockSegments, CopyPlan

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class _CudaArray:
    """The smallest object `torch.as_tensor` accepts as a view of raw device memory."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
            "strides": None, "version": 3, "stream": None,
        }


def raw_byte_view(pointer: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over memory someone else owns (the caller keeps it alive)."""
    if device.type == "cuda":
        return torch.as_tensor(_CudaArray(pointer, nbytes), device=device)
    array = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_uint8)),
                                  shape=(nbytes,))
    return torch.from_numpy(array)


class AddressSpan:
    """Every allocation of one engine as rows of one tensor."""

    def __init__(self, allocations: list[torch.Tensor]) -> None:
        pointers = [a.data_ptr() for a in allocations]
        self.base = min(pointers)
        end = max(p + a.numel() for p, a in zip(pointers, allocations, strict=True))
        self.allocation_offset = np.array([p - self.base for p in pointers], dtype=np.int64)
        if len(allocations) == 1:
            self.bytes = allocations[0]
        else:
            self.bytes = raw_byte_view(self.base, end - self.base, allocations[0].device)

    def engine_offsets(self, plan: CopyPlan) -> np.ndarray:
        """Each copy's engine-side byte offset from the span's base."""
        return self.allocation_offset[plan.allocation] + plan.engine_offset

    def row_bytes(self, plan: CopyPlan) -> int:
        """The largest row size every copy of `plan` is made of. Staging buffers hold the
        copies back to back, so lengths and engine offsets are all that must divide."""
        if not len(plan):
            return 1
        # Long rows keep the index small (host work per operation is what limits stores
        # and retrieves together). torch's index_copy_ is slower on them, yet cutting
        # rows shorter cost more host time than it saved (docs/benchmarks.md).
        return gcd(int(np.gcd.reduce(plan.length)), int(np.gcd.reduce(self.engine_offsets(plan))))

    def rows(self, row_bytes: int) -> torch.Tensor:
        """The span as `[rows, words]`, words as wide as the alignment allows."""
        word = _word_bytes(row_bytes, self.base)
        n = self.bytes.numel() // row_bytes
        return self.bytes[:n * row_bytes].view(_WORD_DTYPES[word]).view(n, row_bytes // word)


def _word_bytes(row_bytes: int, pointer: int) -> int:
    """Widest integer word that divides the row and the base address (wider loads)."""
    for word in (8, 4, 2):
        if row_bytes % word == 0 and pointer % word == 0:
            return word
    return 1


def word_rows(buffer: torch.Tensor, row_bytes: int, span_base: int) -> torch.Tensor:
    """A staging byte buffer as rows whose words match `AddressSpan.rows` for the span."""
    word = _word_bytes(row_bytes, span_base)
    n = buffer.numel() // row_bytes
    return buffer[:n * row_bytes].view(_WORD_DTYPES[word]).view(n, row_bytes // word)


def expand_rows(starts: np.ndarray, lengths: np.ndarray, row_bytes: int) -> np.ndarray:
    """Row numbers covering each [start, start + length) byte range, in order."""
    counts = lengths // row_bytes
    first = starts // row_bytes
    before = np.cumsum(counts) - counts
    return np.repeat(first - before, counts) + np.arange(int(counts.sum()), dtype=np.int64)


class BlockRows:
    """The rows of `span` holding each block's bytes, in chunk order: block b's rows are
    `base + b * stride` (one stride per row, or one for all when every layer's block
    stride is the same), so an operation's index is one broadcast add on the device."""

    def __init__(self, span: AddressSpan, segments: BlockSegments, device: torch.device
                 ) -> None:
        # Block 0's segments as offsets from the span's base; the row size must divide
        # those, the lengths and the strides, so that every block's rows start on a row.
        offsets = span.allocation_offset[segments.allocation] + segments.base
        self.row_bytes = int(np.gcd.reduce(np.concatenate(
            (segments.length, offsets, segments.stride))))
        counts = segments.length // self.row_bytes
        base = expand_rows(offsets, segments.length, self.row_bytes)
        strides = np.repeat(segments.stride // self.row_bytes, counts)
        self.rows_per_block = len(base)
        self.engine_rows = span.rows(self.row_bytes)
        self.word = _word_bytes(self.row_bytes, span.base)
        # Uploaded once, synchronously, before any operation can use them.
        self._base = torch.from_numpy(base).to(device)
        self._stride: int | None = None
        self._strides: torch.Tensor | None = None
        if len(strides) and bool((strides == strides[0]).all()):
            self._stride = int(strides[0])
        else:
            self._strides = torch.from_numpy(strides).to(device)

    def index(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Row numbers of blocks `block_ids` (a `[n, 1]` int64 column on the span's
        device), block after block: `[n * rows_per_block]`."""
        if self._strides is None:
            rows = torch.add(self._base, block_ids, alpha=self._stride)
        else:
            rows = torch.addcmul(self._base, block_ids, self._strides)
        return rows.view(-1)
