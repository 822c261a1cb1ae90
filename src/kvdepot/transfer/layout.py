"""Where a KV block's bytes lie in an engine's memory, for any tensor layout.

Every registered layer is a strided view (dtype, shape, strides, storage offset) into
one of the engine's allocations, with one dimension indexing blocks. One block of one
layer is then a short list of contiguous byte segments: one for layouts whose block
dimension is outermost (vLLM CPU's LBHNC, `[num_blocks, 2, block_size, heads, dim]`,
MLA's `[num_blocks, block_size, dim]`), one per K/V half for FlashAttention's
`[2, num_blocks, block_size, heads, dim]`, more for anything stranger.

A chunk's bytes in the cache are those segments in a fixed order (for each block of
the chunk, for each distinct layer, each segment), independent of where the engine
keeps its layers. So two engines with the same model and layout produce identical
chunks even if their allocations differ, and the same description drives the CPU
and the CUDA copy backends.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from blake3 import blake3

from kvdepot.errors import InvalidRequest
from kvdepot.protocol import LayerSpec

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
               torch.uint8, torch.int16, torch.int32, torch.int64, torch.float8_e4m3fn,
               torch.float8_e5m2)
}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidRequest(f"unsupported KV cache dtype {name!r}") from None


def _contiguous_runs(shape: list[int], strides: list[int]) -> tuple[list[tuple[int, int]], int]:
    """Split an index space into the dims to enumerate and one contiguous trailing run.

    Returns ([(size, stride), ...] of the leading dims to enumerate, run length in elements).
    """
    run = 1
    k = len(shape)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == run):
        run *= shape[k - 1]
        k -= 1
    return [(shape[i], strides[i]) for i in range(k)], run


def _enumerate_offsets(dims: list[tuple[int, int]]) -> np.ndarray:
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in dims:
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * stride).reshape(-1)
    return offsets


MAX_BLOCK_SEGMENTS = 1 << 16
"""Contiguous segments of one block, summed over a registration's layers. vLLM's layouts
have one or two per layer; the bound keeps a layout's arrays (built once, at
registration) small whatever a registration claims."""


@dataclass(frozen=True)
class LayerGeometry:
    allocation: int
    num_blocks: int
    block_stride: int
    """Bytes between consecutive blocks."""
    base: int
    """Byte offset of block 0's first segment's origin in the allocation."""
    segment_offsets: np.ndarray
    """Byte offsets of one block's segments, relative to the block's origin."""
    segment_bytes: int
    signature: tuple
    """What a reader's layer must match for stored bytes to mean the same thing."""

    @property
    def block_bytes(self) -> int:
        return len(self.segment_offsets) * self.segment_bytes


@dataclass(frozen=True)
class _LayerView:
    """A layer's view, validated, and how one block splits into segments; computed from
    the few numbers of the spec alone, before anything proportional to its sizes."""

    spec: LayerSpec
    itemsize: int
    outer: list[tuple[int, int]]
    """(size, stride) of the dimensions before the block axis."""
    inner: list[int]
    """The dimensions after the block axis, in memory order."""
    inner_dims: list[tuple[int, int]]
    """(size, stride) of the inner dimensions enumerated segment by segment."""
    run: int
    """Elements per segment."""

    @property
    def segments(self) -> int:
        return math.prod(size for size, _ in self.outer) * math.prod(
            size for size, _ in self.inner_dims)


def _check_distinct_elements(spec: LayerSpec) -> None:
    """Every index of the view must name its own element: a zero stride, or strides
    that let two indices meet, would make a store read one byte as many (and a
    retrieve write it many times). In increasing stride order, each stride must reach
    past everything the smaller ones span."""
    span = 0
    for stride, size in sorted((s, d) for d, s in zip(spec.shape, spec.strides, strict=True)
                               if d > 1):
        if stride <= span:
            what = "a zero stride" if stride == 0 else "overlapping strides"
            raise InvalidRequest(f"layer {spec.name!r}: shape {spec.shape} with strides "
                                 f"{spec.strides} has {what}: two indices name one element")
        span += (size - 1) * stride


def _layer_view(spec: LayerSpec, allocation_bytes: int) -> _LayerView:
    dtype = dtype_from_name(spec.dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    ndim = len(spec.shape)
    if ndim < 2 or len(spec.strides) != ndim:
        raise InvalidRequest(f"layer {spec.name!r}: shape {spec.shape} / strides {spec.strides} "
                             "do not describe a KV cache")
    if not 0 <= spec.block_axis < ndim:
        raise InvalidRequest(f"layer {spec.name!r}: block axis {spec.block_axis} out of range")
    if (any(s < 0 for s in spec.strides) or any(d <= 0 for d in spec.shape)
            or spec.storage_offset < 0):
        raise InvalidRequest(f"layer {spec.name!r}: negative strides, empty dimensions or a "
                             "negative storage offset are not supported")
    _check_distinct_elements(spec)
    last = spec.storage_offset + sum(
        (d - 1) * s for d, s in zip(spec.shape, spec.strides, strict=True))
    extent = (last + 1) * itemsize
    if extent > allocation_bytes:
        raise InvalidRequest(f"layer {spec.name!r} reaches byte {extent} but its allocation has "
                             f"only {allocation_bytes}")
    axis = spec.block_axis
    outer = list(zip(spec.shape[:axis], spec.strides[:axis], strict=False))
    # A block's bytes go into the chunk in memory order, not in the view's index order:
    # vLLM's `[B, H, N, C]` views over `[B, N, H, C]` memory then copy as one 64 KiB run
    # per layer instead of H x N runs of C elements. The order is part of the signature,
    # since it decides what the stored bytes mean.
    inner = sorted(range(axis + 1, ndim), key=lambda d: -spec.strides[d])
    inner_dims, run = _contiguous_runs([spec.shape[d] for d in inner],
                                       [spec.strides[d] for d in inner])
    return _LayerView(spec, itemsize, outer, inner, inner_dims, run)


def _layer_geometry(view: _LayerView) -> LayerGeometry:
    spec, itemsize, axis = view.spec, view.itemsize, view.spec.block_axis
    offsets = (_enumerate_offsets(view.outer)[:, None]
               + _enumerate_offsets(view.inner_dims)[None, :])
    per_block_shape = spec.shape[:axis] + spec.shape[axis + 1:]
    return LayerGeometry(
        allocation=spec.allocation,
        num_blocks=spec.shape[axis],
        block_stride=spec.strides[axis] * itemsize,
        base=spec.storage_offset * itemsize,
        segment_offsets=offsets.reshape(-1) * itemsize,
        segment_bytes=view.run * itemsize,
        signature=(spec.dtype, axis, tuple(per_block_shape), tuple(view.inner)),
    )


@dataclass(frozen=True)
class BlockSegments:
    """One block's bytes as contiguous segments in chunk order, where every segment moves
    with the block id: segment j of block b lies at `base[j] + b * stride[j]` in allocation
    `allocation[j]`. Neighbours that are adjacent for every block id are merged."""

    allocation: np.ndarray
    base: np.ndarray
    stride: np.ndarray
    length: np.ndarray
    chunk_offset: np.ndarray
    """Offset of each segment in a block's bytes in a chunk."""

    def __len__(self) -> int:
        return len(self.length)


class CopyPlan:
    """Copies between engine memory and chunk buffers for one operation.

    The operation is its block ids in chunk order: the block in slot i goes to slot
    i % blocks_per_chunk of chunk i // blocks_per_chunk, and slots before `first_slot`
    are left out. The staged CUDA path needs no more than that (it builds its row index
    on the GPU from the block ids), so the per-copy arrays (`allocation`, ...,
    `length`; adjacent copies merged) are built only when first asked for, by the
    paths that walk them (CPU memcpy, one DMA per segment).
    """

    def __init__(self, layout: KVLayout, block_ids: np.ndarray, blocks_per_chunk: int,
                 first_slot: int = 0) -> None:
        self.layout = layout
        self.group = layout.group
        """The KV cache group of the engine whose blocks these are (`KVLayout.group`)."""
        self.block_ids = block_ids
        """The blocks copied: those of slots first_slot, first_slot + 1, ..., as int64."""
        self.blocks_per_chunk = blocks_per_chunk
        self.first_slot = first_slot

    @property
    def nbytes(self) -> int:
        return len(self.block_ids) * self.layout.block_bytes

    def chunk_ranges(self) -> list[tuple[int, int, int, int, int]]:
        """(chunk, byte offset in its buffer, bytes, first block, end block) for every
        chunk the plan touches, in order; blocks index `block_ids`. A chunk's bytes are
        its blocks' bytes one after the other, so each chunk is one contiguous range."""
        bpc = self.blocks_per_chunk
        block_bytes = self.layout.block_bytes
        first = self.first_slot
        end = first + len(self.block_ids)
        out: list[tuple[int, int, int, int, int]] = []
        slot = first
        while slot < end:
            chunk = slot // bpc
            stop = min((chunk + 1) * bpc, end)
            out.append((chunk, (slot - chunk * bpc) * block_bytes, (stop - slot) * block_bytes,
                        slot - first, stop - first))
            slot = stop
        return out

    def mean_copy_bound(self) -> float:
        """An upper bound of the mean merged copy length, from the layout alone: a chunk
        of k blocks of S segments is at least k * (S - 1) + 1 copies, since only a block's
        last segment can run on into the next block's first. (Segments whose strides
        differ may still merge for particular block ids; the bound is then a little low,
        which only matters to the choice of copy path.)"""
        k = min(self.blocks_per_chunk, max(len(self.block_ids), 1))
        segments = len(self.layout.block_segments)
        return k * self.layout.block_bytes / (k * (segments - 1) + 1)

    @cached_property
    def _copies(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.layout.copies(self.block_ids, self.blocks_per_chunk, self.first_slot)

    @property
    def allocation(self) -> np.ndarray:
        """Which engine allocation each copy touches."""
        return self._copies[0]

    @property
    def engine_offset(self) -> np.ndarray:
        """Byte offset in that allocation."""
        return self._copies[1]

    @property
    def chunk_index(self) -> np.ndarray:
        """Which chunk of the operation the copy belongs to."""
        return self._copies[2]

    @property
    def chunk_offset(self) -> np.ndarray:
        """Byte offset inside that chunk's buffer."""
        return self._copies[3]

    @property
    def length(self) -> np.ndarray:
        return self._copies[4]

    def __len__(self) -> int:
        """The number of merged copies (builds them)."""
        return len(self._copies[4])

    def each_copy(self) -> Iterator[tuple[int, int, int, int, int]]:
        """(allocation, engine offset, chunk, offset in chunk, length) of every copy, as
        Python ints, for copiers that issue one copy at a time."""
        return zip(*(column.tolist() for column in self._copies), strict=True)


class KVLayout:
    """The registered KV cache of one engine worker, as copyable byte segments."""

    def __init__(self, layers: list[LayerSpec], allocation_bytes: list[int], block_size: int,
                 group: int = 0) -> None:
        """`group`: which of the engine's KV cache groups these layers are (0 for an
        engine with one)."""
        if not layers:
            raise InvalidRequest("no KV cache layers were registered")
        self.group = group
        if block_size <= 0:
            raise InvalidRequest(f"block size must be positive, got {block_size}")
        for spec in layers:
            if not 0 <= spec.allocation < len(allocation_bytes):
                raise InvalidRequest(f"layer {spec.name!r} names allocation {spec.allocation}, "
                                     f"but {len(allocation_bytes)} were registered")
        # Several layer names may alias one view; copying it once is enough and keeps the
        # chunk format independent of how many aliases an engine happens to have.
        seen: set[tuple] = set()
        distinct: list[LayerSpec] = []
        for spec in layers:
            ident = (spec.allocation, spec.dtype, tuple(spec.shape), tuple(spec.strides),
                     spec.storage_offset, spec.block_axis)
            if ident not in seen:
                seen.add(ident)
                distinct.append(spec)
        self.layer_names = [spec.name for spec in layers]
        views = [_layer_view(s, allocation_bytes[s.allocation]) for s in distinct]
        segments = sum(view.segments for view in views)
        if segments > MAX_BLOCK_SEGMENTS:
            raise InvalidRequest(f"one block of this KV cache is {segments} separate pieces of "
                                 f"memory; at most {MAX_BLOCK_SEGMENTS} are supported")
        self.geometries = [_layer_geometry(view) for view in views]
        self.block_size = block_size
        self.num_blocks = min(g.num_blocks for g in self.geometries)
        self.block_bytes = sum(g.block_bytes for g in self.geometries)
        self.fingerprint = blake3(repr(
            (block_size, [g.signature for g in self.geometries],
             [(len(g.segment_offsets), g.segment_bytes) for g in self.geometries])
        ).encode()).digest()[:16]
        # One block's segments across all layers, in chunk order, as arrays.
        alloc, base, stride, rel, length = [], [], [], [], []
        for g in self.geometries:
            n = len(g.segment_offsets)
            alloc.append(np.full(n, g.allocation, dtype=np.int64))
            base.append(np.full(n, g.base, dtype=np.int64))
            stride.append(np.full(n, g.block_stride, dtype=np.int64))
            rel.append(g.segment_offsets)
            length.append(np.full(n, g.segment_bytes, dtype=np.int64))
        self.block_segments = _merge_block_segments(
            np.concatenate(alloc), np.concatenate(base) + np.concatenate(rel),
            np.concatenate(stride), np.concatenate(length))

    def chunk_bytes(self, chunk_size: int) -> int:
        return blocks_per_chunk(chunk_size, self.block_size) * self.block_bytes

    def validate_blocks(self, block_ids: np.ndarray) -> None:
        """Every id inside the registered cache, and none twice: one operation writing (or
        reading) a block for two token ranges is always an engine bug."""
        if len(block_ids) and (block_ids.min() < 0 or block_ids.max() >= self.num_blocks):
            bad = block_ids[(block_ids < 0) | (block_ids >= self.num_blocks)][0]
            raise InvalidRequest(f"block id {int(bad)} is outside the registered KV cache "
                                 f"(valid ids: 0..{self.num_blocks - 1})")
        if len(block_ids) > 1:
            ordered = np.sort(block_ids)
            repeated = ordered[1:][ordered[1:] == ordered[:-1]]
            if len(repeated):
                raise InvalidRequest(f"block id {int(repeated[0])} appears more than once in "
                                     "one operation")

    def plan(self, block_ids: np.ndarray, blocks_per_chunk: int, first_slot: int = 0
             ) -> CopyPlan:
        """Copies moving `block_ids` (in order) to/from chunk buffers of `blocks_per_chunk`
        blocks each: block i goes to slot i % blocks_per_chunk of chunk i // blocks_per_chunk.
        Slots before `first_slot` are left out (blocks a retrieve must not write)."""
        return CopyPlan(self, block_ids[first_slot:].astype(np.int64, copy=False),
                        blocks_per_chunk, first_slot)

    def copies(self, ids: np.ndarray, blocks_per_chunk: int, first_slot: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(allocation, engine offset, chunk, offset in chunk, length) of every contiguous
        copy moving blocks `ids` of slots first_slot, first_slot + 1, ..., merged."""
        seg = self.block_segments
        slot = np.arange(first_slot, first_slot + len(ids), dtype=np.int64)
        engine = (seg.base[None, :] + ids[:, None] * seg.stride[None, :]).reshape(-1)
        within = ((slot % blocks_per_chunk)[:, None] * self.block_bytes
                  + seg.chunk_offset[None, :]).reshape(-1)
        chunk = np.repeat(slot // blocks_per_chunk, len(seg))
        alloc = np.tile(seg.allocation, len(ids))
        length = np.tile(seg.length, len(ids))
        if len(length) <= 1:
            return alloc, engine, chunk, within, length
        # A copy continues the previous one when both sides are adjacent in memory;
        # chunk buffers are separate allocations, so never across a chunk boundary.
        joins = ((alloc[1:] == alloc[:-1]) & (chunk[1:] == chunk[:-1])
                 & (engine[1:] == engine[:-1] + length[:-1])
                 & (within[1:] == within[:-1] + length[:-1]))
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        return (alloc[starts], engine[starts], chunk[starts], within[starts],
                np.add.reduceat(length, starts))


def _merge_block_segments(alloc: np.ndarray, base: np.ndarray, stride: np.ndarray,
                          length: np.ndarray) -> BlockSegments:
    """Merge neighbouring segments that are adjacent whatever the block id (same
    allocation, same stride, one ending where the next begins): a cross-layer layout's
    block becomes one segment instead of one per layer. The merged copies of any plan
    are the same either way; there are just fewer to merge per operation."""
    joins = ((alloc[1:] == alloc[:-1]) & (stride[1:] == stride[:-1])
             & (base[1:] == base[:-1] + length[:-1]))
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = np.add.reduceat(length, starts)
    return BlockSegments(alloc[starts], base[starts], stride[starts], merged,
                         np.concatenate(([0], np.cumsum(merged)[:-1])).astype(np.int64))


def blocks_per_chunk(chunk_size: int, block_size: int) -> int:
    if chunk_size % block_size:
        raise InvalidRequest(f"chunk size {chunk_size} is not a multiple of the engine block "
                             f"size {block_size}")
    return chunk_size // block_size
