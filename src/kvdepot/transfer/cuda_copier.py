"""Copies between an engine's GPU KV cache (mapped through CUDA IPC) and pinned chunk buffers.

Each direction has its own stream, staging buffer and lock, so a store (device to host)
and a retrieve (host to device) run at the same time on different copy engines, while
two stores of one engine queue behind each other on one stream (they would only share
the link). The lock covers queueing the copies, not waiting for them.

Before touching engine memory the stream waits on the engine's interprocess event, so
the copy sees what the engine's kernels wrote up to the point it recorded the event.
`gather` and `scatter` return only once the copy has finished on the GPU: a stored chunk
is committed right after, and a retrieve's reply tells the engine its blocks are ready.

How the bytes move depends on how long the plan's contiguous segments are (figures from
one H200 on PCIe 5 x16, 55 GB/s each way; docs/benchmarks.md):
- short segments (FlashAttention's per-layer `[2, blocks, ...]`: 32 KiB each; MLA: 72 KiB):
  a DMA per segment reaches 3 GB/s (per-copy launch cost), so one indexed-copy kernel
  packs a piece of the plan into a GPU staging buffer (HBM speed: ~20 us per 32 MiB
  chunk) and each chunk crosses PCIe as one DMA: 50 GB/s. Retrieves run it backwards.
- segments of several MiB (cross-layer layouts whose blocks happen to be consecutive):
  one DMA each, straight between engine memory and the chunk buffer, no kernel at all.
  Between those, 2 MiB segments (a cross-layer block) reach the link alone by DMA too,
  but queueing 64 DMAs per operation costs the server enough CPU (Python, one GIL) that
  stores and retrieves together reach 67 GB/s against 93 GB/s staged, so they are staged.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvdepot.errors import NotRegistered
from kvdepot.transfer.address_span import AddressSpan, expand_rows, word_rows
from kvdepot.transfer.layout import CopyPlan

DIRECT_MIN_SEGMENT = 4 << 20
"""Mean segment length from which each segment is its own DMA (see the module note)."""
STAGING_BYTES = 128 << 20
"""GPU staging per direction; a piece of a plan is as many whole chunks as fit (at least
one), so a copy engine always gets a whole chunk per DMA."""
MODE_VARIABLE = "KVDEPOT_CUDA_COPY"
"""`auto` (default), `dma` (always one DMA per segment) or `kernel` (always stage)."""


class _Lane:
    """One direction's stream, staging memory and lock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.lock = threading.Lock()
        self.staging = torch.empty(0, dtype=torch.uint8, device=device)

    def staging_for(self, nbytes: int) -> torch.Tensor:
        if self.staging.numel() < nbytes:
            # Grown on the lane's own stream; the previous buffer's last use was on it too.
            self.staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.staging


class CudaCopier:
    """Runs copy plans for one engine worker whose KV cache lives on `device`."""

    def __init__(self, device: torch.device, allocations: list[torch.Tensor],
                 storages: list[torch.UntypedStorage], mode: str | None = None) -> None:
        self.device = device
        self.allocations = allocations
        self._storages = storages
        self._span = AddressSpan(allocations)
        self.mode = mode or os.environ.get(MODE_VARIABLE, "auto")
        if self.mode not in ("auto", "dma", "kernel"):
            raise ValueError(f"{MODE_VARIABLE} must be auto, dma or kernel, not {self.mode!r}")
        with torch.cuda.device(device):
            self._store_lane = _Lane(device)
            self._retrieve_lane = _Lane(device)
        self._closed = False

    # ---- Copier -------------------------------------------------------------------------
    def gather(self, plan: CopyPlan, chunks: Sequence[np.ndarray],
               event_handle: bytes | None = None) -> None:
        """Engine blocks -> chunk buffers (a store); returns once the bytes are there."""
        self._run(self._store_lane, plan, chunks, event_handle, to_host=True)

    def scatter(self, plan: CopyPlan, chunks: Sequence[np.ndarray],
                event_handle: bytes | None = None) -> bytes | None:
        """Chunk buffers -> engine blocks (a retrieve); returns once the blocks are written,
        so no completion event is needed: the reply itself says the blocks are ready."""
        self._run(self._retrieve_lane, plan, chunks, event_handle, to_host=False)
        return None

    def close(self) -> None:
        """Waits for copies in flight, then drops every mapping of the engine's memory."""
        with self._store_lane.lock, self._retrieve_lane.lock:
            if self._closed:
                return
            self._closed = True
            for lane in (self._store_lane, self._retrieve_lane):
                lane.stream.synchronize()
                lane.staging = torch.empty(0, dtype=torch.uint8, device=self.device)
            self.allocations = []
            self._storages = []
            self._span = None  # type: ignore[assignment]
        # Closing an IPC mapping happens when its last storage goes; ipc_collect then
        # frees what the producer side of this process still holds for it.
        torch.cuda.ipc_collect()

    # ---- the copies ---------------------------------------------------------------------
    def _direct(self, plan: CopyPlan) -> bool:
        if self.mode != "auto":
            return self.mode == "dma"
        return len(plan) > 0 and int(plan.length.sum()) // len(plan) >= DIRECT_MIN_SEGMENT

    def _run(self, lane: _Lane, plan: CopyPlan, chunks: Sequence[np.ndarray],
             event_handle: bytes | None, to_host: bool) -> None:
        if not len(plan):
            return
        hosts = [torch.from_numpy(c) for c in chunks]
        with lane.lock:
            if self._closed:
                raise NotRegistered("the engine unregistered while its copy was queued")
            with torch.cuda.device(self.device), torch.cuda.stream(lane.stream):
                if self._direct(plan):
                    self._wait_engine(lane, event_handle)
                    self._copy_segments(plan, hosts, to_host)
                else:
                    self._copy_staged(lane, plan, hosts, to_host, event_handle)
                done = torch.cuda.Event(blocking=True)  # sleeps, instead of spinning a core
                done.record(lane.stream)
        # Waiting outside the lock lets the next operation queue its copies behind this
        # one on the same stream, so the copy engine never idles between operations.
        done.synchronize()

    def _wait_engine(self, lane: _Lane, event_handle: bytes | None) -> None:
        if event_handle:
            lane.stream.wait_event(torch.cuda.Event.from_ipc_handle(self.device, event_handle))

    def _copy_segments(self, plan: CopyPlan, hosts: list[torch.Tensor], to_host: bool) -> None:
        engine = self.allocations
        for a, e, c, w, n in zip(plan.allocation.tolist(), plan.engine_offset.tolist(),
                                 plan.chunk_index.tolist(), plan.chunk_offset.tolist(),
                                 plan.length.tolist(), strict=True):
            if to_host:
                hosts[c][w:w + n].copy_(engine[a][e:e + n], non_blocking=True)
            else:
                engine[a][e:e + n].copy_(hosts[c][w:w + n], non_blocking=True)

    def _copy_staged(self, lane: _Lane, plan: CopyPlan, hosts: list[torch.Tensor],
                     to_host: bool, event_handle: bytes | None) -> None:
        span = self._span
        row = span.row_bytes(plan)
        engine_rows = span.rows(row)
        rows = expand_rows(span.engine_offsets(plan), plan.length, row)
        # The index crosses PCIe before the wait, so it never delays the copy itself.
        index = torch.from_numpy(rows).pin_memory().to(self.device, non_blocking=True)
        self._wait_engine(lane, event_handle)
        for first, last in _pieces(plan, STAGING_BYTES):
            nbytes = int(plan.length[first:last].sum())
            staging = lane.staging_for(nbytes)[:nbytes]
            staged_rows = word_rows(staging, row, span.base)
            row0 = int(plan.length[:first].sum()) // row
            piece_index = index[row0:row0 + nbytes // row]
            if to_host:
                torch.index_select(engine_rows, 0, piece_index, out=staged_rows)
            for c, w, n, s in _chunk_ranges(plan, first, last):
                if to_host:
                    hosts[c][w:w + n].copy_(staging[s:s + n], non_blocking=True)
                else:
                    staging[s:s + n].copy_(hosts[c][w:w + n], non_blocking=True)
            if not to_host:
                engine_rows.index_copy_(0, piece_index, staged_rows)


def _pieces(plan: CopyPlan, limit: int) -> list[tuple[int, int]]:
    """Split the plan's copies into runs of whole chunks of at most `limit` bytes (a
    single chunk larger than that forms a run of its own)."""
    boundaries = np.flatnonzero(np.diff(plan.chunk_index)) + 1
    starts = np.concatenate(([0], boundaries)).tolist()
    ends = [*starts[1:], len(plan)]
    cumulative = np.concatenate(([0], np.cumsum(plan.length)))
    pieces: list[tuple[int, int]] = []
    first = starts[0]
    for s, e in zip(starts, ends, strict=True):
        if e > first and s > first and cumulative[e] - cumulative[first] > limit:
            pieces.append((first, s))
            first = s
    pieces.append((first, len(plan)))
    return pieces


def _chunk_ranges(plan: CopyPlan, first: int, last: int) -> list[tuple[int, int, int, int]]:
    """(chunk, offset in chunk, bytes, offset in staging) for each chunk of a piece: a
    plan covers each chunk's bytes as one contiguous range, in order."""
    out: list[tuple[int, int, int, int]] = []
    staged = 0
    chunk_index = plan.chunk_index[first:last]
    lengths = plan.length[first:last]
    offsets = plan.chunk_offset[first:last]
    boundaries = np.flatnonzero(np.diff(chunk_index)) + 1
    for s, e in zip([0, *boundaries.tolist()], [*boundaries.tolist(), last - first],
                    strict=True):
        n = int(lengths[s:e].sum())
        if int(offsets[e - 1] + lengths[e - 1] - offsets[s]) != n:
            raise RuntimeError("a copy plan does not cover its chunk as one range")
        out.append((int(chunk_index[s]), int(offsets[s]), n, staged))
        staged += n
    return out
