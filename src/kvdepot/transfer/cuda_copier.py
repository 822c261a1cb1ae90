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

The staged path's host work is what limits layouts of small chunks (MLA: 17 MiB) when
both directions run, since every operation's Python holds the server's one GIL. So it
does no per-copy work on the host: the layout's row pattern is uploaded once
(`BlockRows`), an operation sends just its block ids from a page-locked ring, the GPU
expands them into the row index, and the host computes one range per chunk.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvdepot.errors import NotRegistered
from kvdepot.transfer.address_span import AddressSpan, BlockRows, word_rows
from kvdepot.transfer.layout import CopyPlan, KVLayout

DIRECT_MIN_SEGMENT = 4 << 20
"""Mean segment length from which each segment is its own DMA (see the module note)."""
STAGING_BYTES = 128 << 20
"""GPU staging per direction; a piece of a plan is as many whole chunks as fit (at least
one), so a copy engine always gets a whole chunk per DMA."""
MODE_VARIABLE = "KVDEPOT_CUDA_COPY"
"""`auto` (default), `dma` (always one DMA per segment) or `kernel` (always stage)."""
ID_SLOTS = 16
ID_SLOT_BLOCKS = 8192
"""Block ids one slot of the page-locked ring holds (an operation of 131k tokens in
16-token blocks); larger operations pin a copy of their own."""


class _IdRing:
    """Page-locked slots from which each staged operation's block ids cross to the GPU.

    Pinning a fresh copy per operation cost a page-locked allocation each time, and a
    pageable source would let the driver stage it however it likes (possibly waiting for
    the stream, i.e. for the copies queued before it). A slot is written again only once
    the copy that read it has run: it keeps the completion event of the operation that
    last used it (recorded after all of that operation's work on the same stream) and
    waits on it first, which in practice finished long ago, `ID_SLOTS` operations back.
    Used under the lane's lock only.
    """

    def __init__(self) -> None:
        # [slots, blocks, 1]: a slot's prefix is already the column BlockRows.index takes.
        self._host = torch.empty((ID_SLOTS, ID_SLOT_BLOCKS, 1), dtype=torch.int64,
                                 pin_memory=True)
        self._array = self._host.numpy()[:, :, 0]
        self._done: list[torch.cuda.Event | None] = [None] * ID_SLOTS
        self._next = 0
        self._pending: int | None = None

    def upload(self, ids: np.ndarray, device: torch.device) -> torch.Tensor:
        """`ids` as an `[n, 1]` int64 column on `device`, copied on the current stream."""
        n = len(ids)
        if n > ID_SLOT_BLOCKS:
            # torch's caching host allocator keeps this pinned copy until its copy has run.
            column = torch.from_numpy(ids.astype(np.int64)).view(n, 1).pin_memory()
            return column.to(device, non_blocking=True)
        slot = self._next
        self._next = (slot + 1) % ID_SLOTS
        done = self._done[slot]
        if done is not None:
            done.synchronize()
        self._array[slot, :n] = ids
        self._pending = slot
        return self._host[slot, :n].to(device, non_blocking=True)

    def settle(self, done: torch.cuda.Event) -> None:
        """The slot uploaded last is free again once `done` (recorded after it) is."""
        if self._pending is not None:
            self._done[self._pending] = done
            self._pending = None


class _Lane:
    """One direction's stream, staging memory, id ring and lock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.lock = threading.Lock()
        self.staging = torch.empty(0, dtype=torch.uint8, device=device)
        self._rows: dict[int, torch.Tensor] = {}
        self.ids = _IdRing()

    def staging_rows(self, nbytes: int, row_bytes: int, span_base: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The staging buffer (at least `nbytes`) as bytes and as rows matching the span."""
        if self.staging.numel() < nbytes:
            # Grown on the lane's own stream; the previous buffer's last use was on it too.
            self.staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._rows.clear()
        rows = self._rows.get(row_bytes)
        if rows is None:
            rows = self._rows[row_bytes] = word_rows(self.staging, row_bytes, span_base)
        return self.staging, rows

    def drop_staging(self) -> None:
        self.staging = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._rows.clear()


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
        self._rows: tuple[KVLayout, BlockRows] | None = None
        self._rows_lock = threading.Lock()
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
                lane.drop_staging()
            self.allocations = []
            self._storages = []
            self._span = None  # type: ignore[assignment]
            self._rows = None
        # Closing an IPC mapping happens when its last storage goes; ipc_collect then
        # frees what the producer side of this process still holds for it.
        torch.cuda.ipc_collect()

    # ---- the copies ---------------------------------------------------------------------
    def _direct(self, plan: CopyPlan) -> bool:
        if self.mode != "auto":
            return self.mode == "dma"
        # The bound comes from the layout alone, so layouts of many short segments per
        # block (FlashAttention, MLA) never pay for building the per-copy arrays.
        if plan.mean_copy_bound() < DIRECT_MIN_SEGMENT:
            return False
        return plan.nbytes // len(plan) >= DIRECT_MIN_SEGMENT

    def _block_rows(self, layout: KVLayout) -> BlockRows:
        """The layout's row pattern, uploaded on first use (one layout per registration)."""
        cached = self._rows
        if cached is not None and cached[0] is layout:
            return cached[1]
        with self._rows_lock:
            if self._rows is None or self._rows[0] is not layout:
                self._rows = (layout, BlockRows(self._span, layout.block_segments,
                                                self.device))
            return self._rows[1]

    def _run(self, lane: _Lane, plan: CopyPlan, chunks: Sequence[np.ndarray],
             event_handle: bytes | None, to_host: bool) -> None:
        if not len(plan.block_ids):
            return
        hosts = [torch.from_numpy(c) for c in chunks]
        done: torch.cuda.Event | None = None
        try:
            with lane.lock:
                if self._closed:
                    raise NotRegistered("the engine unregistered while its copy was queued")
                with torch.cuda.device(self.device), torch.cuda.stream(lane.stream):
                    try:
                        if self._direct(plan):
                            self._wait_engine(lane, event_handle)
                            self._copy_segments(plan, hosts, to_host)
                        else:
                            self._copy_staged(lane, plan, hosts, to_host, event_handle)
                    finally:
                        # Recorded even when queueing failed half way, so that nothing
                        # queued is left running once this returns or raises.
                        done = torch.cuda.Event(blocking=True)  # sleeps, not spins
                        done.record(lane.stream)
                        lane.ids.settle(done)
        finally:
            # Waiting outside the lock lets the next operation queue its copies behind
            # this one on the same stream, so the copy engine never idles between them.
            if done is not None:
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
        rows = self._block_rows(plan.layout)
        # The ids cross PCIe and become the row index before the wait on the engine, so
        # neither delays the copy itself.
        index = rows.index(lane.ids.upload(plan.block_ids, self.device))
        self._wait_engine(lane, event_handle)
        base = self._span.base
        staged_copy(plan, rows, index, lambda n: lane.staging_rows(n, rows.row_bytes, base),
                    hosts, to_host)


StagingFor = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""nbytes -> (a staging byte buffer of at least nbytes, the same buffer as span rows)."""


def staged_copy(plan: CopyPlan, rows: BlockRows, index: torch.Tensor, staging_for: StagingFor,
                hosts: Sequence[torch.Tensor], to_host: bool,
                limit: int = STAGING_BYTES) -> None:
    """Queue a staged copy on the current stream: per piece of whole chunks, one gather
    kernel from the engine's rows into staging and one DMA per chunk (a store), or one
    DMA per chunk and one scatter kernel (a retrieve). Device-agnostic, so the unit
    tests run the same steps on CPU memory."""
    block_bytes = plan.layout.block_bytes
    per_block = rows.rows_per_block
    engine_rows = rows.engine_rows
    for piece in _pieces(plan.chunk_ranges(), limit):
        first, last = piece[0][3], piece[-1][4]
        staging, staged = staging_for((last - first) * block_bytes)
        staged = staged[:(last - first) * per_block]
        piece_index = index[first * per_block:last * per_block]
        if to_host:
            torch.index_select(engine_rows, 0, piece_index, out=staged)
        for chunk, offset, nbytes, block, _ in piece:
            s = (block - first) * block_bytes
            if to_host:
                hosts[chunk][offset:offset + nbytes].copy_(staging[s:s + nbytes],
                                                           non_blocking=True)
            else:
                staging[s:s + nbytes].copy_(hosts[chunk][offset:offset + nbytes],
                                            non_blocking=True)
        if not to_host:
            engine_rows.index_copy_(0, piece_index, staged)


Range = tuple[int, int, int, int, int]


def _pieces(ranges: list[Range], limit: int) -> list[list[Range]]:
    """Consecutive chunk ranges grouped into pieces of at most `limit` bytes (a single
    range larger than that forms a piece of its own)."""
    pieces: list[list[Range]] = []
    current: list[Range] = []
    size = 0
    for r in ranges:
        if current and size + r[2] > limit:
            pieces.append(current)
            current, size = [], 0
        current.append(r)
        size += r[2]
    if current:
        pieces.append(current)
    return pieces
