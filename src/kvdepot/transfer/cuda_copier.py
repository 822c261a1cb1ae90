"""Copies between an engine's GPU KV cache (mapped through CUDA IPC) and the page-locked
pool, run in that GPU's copy process (`copy_process.main`).

Each direction has its own streams and staging buffers, so a store (device to host) and
a retrieve (host to device) run at the same time on different copy engines, while two
stores of one engine queue behind each other on one copy stream (they would only share
the link). Every copy on a GPU is queued by the copy process's one queueing thread
(`CudaCopier.queue`), which returns the event recorded after it; another thread waits for
that event before the copy process replies to the server.

Before touching engine memory a stream waits on the engine's interprocess event, so
the copy sees what the engine's kernels wrote up to the point it recorded the event.
The server hears of a copy only once it has finished on the GPU: a stored chunk is
committed right after, and a retrieve's reply tells the engine its blocks are ready.

How the bytes move depends on how long the plan's contiguous segments are (the
measurements behind this are in docs/benchmarks.md):
- short segments (FlashAttention's per-layer `[2, blocks, ...]`, MLA): a DMA per segment
  is bound by its launch cost, so one indexed-copy kernel packs a piece of the plan into a
  GPU staging buffer and each run of chunks adjacent in the host pool crosses PCIe as one
  DMA (`HostChunks`). Retrieves run it backwards.
- segments of several MiB (cross-layer layouts whose blocks happen to be consecutive):
  one DMA each, straight between engine memory and the chunk buffer, no kernel at all.
  Segments of a cross-layer block (2 MiB) are staged too: queueing one DMA each costs
  the one queueing thread more than the link can wait for when both directions run.
- stores of segments of 16 KiB and more (FlashAttention's 32 KiB per layer and block of
  an 8B model) where the driver has `cuMemcpyBatchAsync` (CUDA 12.8 on): every segment's
  DMA in one driver call, no kernel. The copy process's kernels share the GPU with a busy
  engine's by time slices (two processes, no MPS), so each gather costs such an engine a
  switch of contexts whatever its size, which added up to a few percent of a batch of
  distinct prompts. A store waits for no one, so it takes the copy engines' slower pace
  over short segments instead; a retrieve is on a hit's path, so it stays staged.

Host work per operation is what limits small chunks (MLA) with both directions running,
so the staged path does no per-copy work on the host: the layout's row pattern is
uploaded once (`BlockRows`), an operation sends just its block ids from a page-locked
ring, the GPU expands them into the row index, and the host computes one range per
chunk. The kernels run on a stream of their own beside the DMAs (`_Lane`), so the copy
engine does not wait for them either.
"""

from __future__ import annotations

import os
import threading
from typing import Protocol

import numpy as np
import torch

from kvdepot.errors import InvalidRequest, NotRegistered
from kvdepot.transfer.address_span import AddressSpan, BlockRows, raw_byte_view, word_rows
from kvdepot.transfer.cuda_driver import CudaDriver, CudaDriverError, cuda_driver
from kvdepot.transfer.host_chunks import HostChunks, Range
from kvdepot.transfer.layout import CopyPlan, KVLayout

DIRECT_MIN_SEGMENT = 4 << 20
"""Mean segment length from which each segment is its own DMA (see the module note)."""
BATCH_MIN_SEGMENT = 16 << 10
"""Mean segment length from which a store's segments go as batches of DMAs rather than
staged (see the module note)."""
BATCH_COPIES = 1 << 16
"""Copies per `cuMemcpyBatchAsync` call at most, so no operation's arrays grow without
bound."""
STAGING_BYTES = 64 << 20
"""Each of the two GPU staging buffers per direction (the same 128 MiB per direction as
one buffer took before); a piece of a plan is as many whole chunks as fit (at least
one), so a copy engine always gets a whole chunk per DMA."""
MODE_VARIABLE = "KVDEPOT_CUDA_COPY"
"""`auto` (default), `dma` (always one DMA per segment), `batch` (always batches of DMAs,
both ways) or `kernel` (always stage)."""
MODES = ("auto", "dma", "batch", "kernel")
STAGING_VARIABLE = "KVDEPOT_CUDA_STAGING"
"""Bytes per staging buffer instead of `STAGING_BYTES` (GPU memory the server takes on an
engine's GPU is four of them); the GPU tests set 1, so every chunk is a piece."""
ID_SLOTS = 16
ID_SLOT_BLOCKS = 8192
"""Block ids one slot of the page-locked ring holds (an operation of 131k tokens in
16-token blocks); larger operations pin a copy of their own."""


class _IdRing:
    """Page-locked slots from which each staged operation's block ids reach the GPU.

    The kernel that expands the ids reads them straight from the slot: page-locked
    memory is mapped into the GPU's address space at the same address, so no copy is
    queued. That is one CUDA call less per operation on the queueing thread, whose
    calls bound the server with many engines (docs/benchmarks.md), and nothing waits
    behind the retrieves' DMAs in the host-to-device queue. A slot is written again only
    once the kernel that read it has run: it keeps the completion event of the
    operation that last used it (recorded after all of that operation's work) and waits
    on it first, which in practice finished long ago, `ID_SLOTS` operations back. Used
    under the lane's lock only.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        # [slots, blocks, 1]: a slot's prefix is already the column BlockRows.index takes.
        self._host = torch.empty((ID_SLOTS, ID_SLOT_BLOCKS, 1), dtype=torch.int64,
                                 pin_memory=True)
        self._array = self._host.numpy()[:, :, 0]
        view = raw_byte_view(self._host.data_ptr(), self._host.nbytes, device)
        # Should torch ever copy the memory instead of viewing it, kernels would read a
        # stale snapshot: then every operation copies its ids instead.
        self._on_device: torch.Tensor | None = (
            view.view(torch.int64).view(self._host.shape)
            if view.data_ptr() == self._host.data_ptr() else None)
        self._done: list[torch.cuda.Event | None] = [None] * ID_SLOTS
        self._next = 0
        self._pending: int | None = None

    def upload(self, ids: np.ndarray) -> torch.Tensor:
        """`ids` as an `[n, 1]` int64 column that kernels on the ring's device can read."""
        n = len(ids)
        if n > ID_SLOT_BLOCKS:
            # torch's caching host allocator keeps this pinned copy until its copy has run.
            column = torch.from_numpy(ids.astype(np.int64)).view(n, 1).pin_memory()
            return column.to(self._device, non_blocking=True)
        slot = self._next
        self._next = (slot + 1) % ID_SLOTS
        done = self._done[slot]
        if done is not None:
            done.synchronize()
        self._array[slot, :n] = ids
        self._pending = slot
        if self._on_device is None:
            return self._host[slot, :n].to(self._device, non_blocking=True)
        return self._on_device[slot, :n]

    def settle(self, done: torch.cuda.Event) -> None:
        """The slot uploaded last is free again once `done` (recorded after it) is."""
        if self._pending is not None:
            self._done[self._pending] = done
            self._pending = None


class _Lane:
    """One direction's two streams, two staging buffers, id ring and lock.

    DMAs run on `copies`; the id upload, the row index and the gather or scatter kernels
    on `kernels`. Pieces of the plans use the two staging buffers in turn, so the kernel
    of the next piece (often the next operation's) runs while this piece's DMAs do: with
    one stream the copy engine idled for every gather and scatter and for each
    operation's small index steps.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copies = torch.cuda.Stream(device)
        self.kernels = torch.cuda.Stream(device)
        self.lock = threading.Lock()
        self.ids = _IdRing(device)
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(2)]
        self._rows: list[dict[int, torch.Tensor]] = [{}, {}]
        self.free: list[torch.cuda.Event | None] = [None, None]
        """Per buffer: recorded after the last work queued on it (None: never used)."""
        self.turn = 0

    def buffer(self, which: int, nbytes: int, row_bytes: int, span_base: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Staging buffer `which` (at least `nbytes`), as bytes and as rows matching the
        span."""
        if self._buffers[which].numel() < nbytes:
            # Both streams may still use the old one, and the caching allocator tracks one
            # stream per block; growing happens a few times per registration at most.
            self.synchronize()
            self._buffers[which] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._rows[which].clear()
        rows = self._rows[which].get(row_bytes)
        if rows is None:
            rows = self._rows[which][row_bytes] = word_rows(self._buffers[which], row_bytes,
                                                            span_base)
        return self._buffers[which], rows

    def staging(self, which: int) -> torch.Tensor:
        """Staging buffer `which` as it is (empty until first taken)."""
        return self._buffers[which]

    def synchronize(self) -> None:
        self.copies.synchronize()
        self.kernels.synchronize()

    def drop_staging(self) -> None:
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=self.device)
                         for _ in range(2)]
        self._rows = [{}, {}]
        self.free = [None, None]


class _Stages:
    """Runs the pieces of one staged operation across the lane's two streams: a store
    gathers on `kernels` and hands the buffer to `copies` for its DMAs; a retrieve DMAs
    on `copies` and hands the buffer to `kernels` for the scatter. A buffer is taken
    only once its previous piece released it (a wait on the GPU, not on the host)."""

    def __init__(self, lane: _Lane, to_host: bool, row_bytes: int, span_base: int) -> None:
        self.lane = lane
        self.first, self.last = ((lane.kernels, lane.copies) if to_host
                                 else (lane.copies, lane.kernels))
        self.row_bytes = row_bytes
        self.span_base = span_base
        self._which = 0

    def begin(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        lane = self.lane
        self._which = which = lane.turn
        lane.turn ^= 1
        staging = lane.buffer(which, nbytes, self.row_bytes, self.span_base)
        released = lane.free[which]
        if released is not None:
            self.first.wait_event(released)
        torch.cuda.set_stream(self.first)
        return staging

    def handoff(self) -> None:
        ready = torch.cuda.Event()
        ready.record(self.first)
        self.last.wait_event(ready)
        torch.cuda.set_stream(self.last)

    def end(self) -> None:
        released = torch.cuda.Event()
        released.record(self.last)
        self.lane.free[self._which] = released


def copy_path(plan: CopyPlan, mode: str, to_host: bool, batches: bool) -> str:
    """How copy mode `mode` moves `plan`, a store's (`to_host`) or a retrieve's: "dma"
    (one DMA per segment), "batch" (every segment's DMA, in as few driver calls as
    `BATCH_COPIES` allows) or "kernel" (staged). `batches`: whether the driver has
    batched copies."""
    if mode != "auto":
        return mode
    # The bound comes from the layout alone, so layouts of many short segments per
    # block (FlashAttention, MLA) never pay for building the per-copy arrays here.
    bound = plan.mean_copy_bound()
    if bound >= DIRECT_MIN_SEGMENT and plan.nbytes // len(plan) >= DIRECT_MIN_SEGMENT:
        return "dma"
    if to_host and batches and bound >= BATCH_MIN_SEGMENT:
        return "batch"
    return "kernel"


def batch_arrays(plan: CopyPlan, engine_bases: np.ndarray, hosts: HostChunks,
                 to_host: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Destination and source addresses and byte counts (uint64) of every copy of `plan`,
    between the engine's allocations (starting at `engine_bases`) and `hosts`."""
    engine = engine_bases[plan.allocation] + plan.engine_offset.astype(np.uint64)
    host = hosts.addresses(plan.chunk_index, plan.chunk_offset)
    sizes = plan.length.astype(np.uint64)
    return (host, engine, sizes) if to_host else (engine, host, sizes)


def batching_driver() -> CudaDriver | None:
    """The process's driver bindings where they have batched copies, else None."""
    try:
        driver = cuda_driver()
    except (CudaDriverError, AttributeError):  # no libcuda, or one without a call we bind
        return None
    return driver if driver.copies_in_batches else None


class CudaCopier:
    """Runs copy plans for one engine worker whose KV cache lives on `device`."""

    def __init__(self, device: torch.device, allocations: list[torch.Tensor],
                 storages: list[torch.UntypedStorage], mode: str | None = None) -> None:
        self.device = device
        self.allocations = allocations
        self._storages = storages
        self._span = AddressSpan(allocations)
        self.mode = mode or os.environ.get(MODE_VARIABLE, "auto")
        if self.mode not in MODES:
            raise ValueError(f"{MODE_VARIABLE} must be one of {', '.join(MODES)}, "
                             f"not {self.mode!r}")
        self._driver = batching_driver()
        if self.mode == "batch" and self._driver is None:
            raise ValueError(f"{MODE_VARIABLE}=batch needs cuMemcpyBatchAsync, which this "
                             "CUDA driver lacks (it came with 12.8)")
        self._engine_bases = np.array([t.data_ptr() for t in allocations], dtype=np.uint64)
        self.staging_bytes = int(os.environ.get(STAGING_VARIABLE, STAGING_BYTES))
        with torch.cuda.device(device):
            self._store_lane = _Lane(device)
            self._retrieve_lane = _Lane(device)
        self._rows: dict[int, tuple[KVLayout, BlockRows]] = {}
        self._rows_lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Waits for copies in flight, then drops every mapping of the engine's memory."""
        with self._store_lane.lock, self._retrieve_lane.lock:
            if self._closed:
                return
            self._closed = True
            for lane in (self._store_lane, self._retrieve_lane):
                lane.synchronize()
                lane.drop_staging()
            self.allocations = []
            self._storages = []
            self._span = None  # type: ignore[assignment]
            self._rows = {}
        # Closing an IPC mapping happens when its last storage goes; ipc_collect then
        # frees what the producer side of this process still holds for it.
        torch.cuda.ipc_collect()

    def warm_up(self, layouts: list[KVLayout]) -> None:
        """Do at registration what the first store and the first retrieve would otherwise
        do on an engine's time: upload each layout's rows, take both lanes' staging
        buffers, and run each lane's index, gather and scatter kernels once, on staging
        memory only (never the engine's or the pool's), so CUDA loads their code now. The
        first retrieve after an engine started was slower than a cold prefill on a GPU."""
        for layout in layouts:
            rows = self._block_rows(layout)
            ids = np.zeros(1, dtype=np.int64)
            for lane in (self._store_lane, self._retrieve_lane):
                with lane.lock, torch.cuda.stream(lane.kernels):
                    index = rows.index(lane.ids.upload(ids))
                    for which in (0, 1):
                        _, staged = lane.buffer(which, self.staging_bytes, rows.row_bytes,
                                                self._span.base)
                        count = min(len(index), len(staged) // 2)
                        head, rest = staged[:count], staged[count:2 * count]
                        within = index[:count].clamp(0, count - 1)
                        torch.index_select(head, 0, within, out=rest)
                        head.index_copy_(0, within, rest)
                    done = torch.cuda.Event()
                    done.record(lane.kernels)
                    lane.ids.settle(done)
                    lane.synchronize()
        if self._driver is not None:
            # And one batched copy, staging to staging, on each lane that may take them.
            lanes = [self._store_lane] + ([self._retrieve_lane] if self.mode == "batch" else [])
            for lane in lanes:
                with lane.lock:
                    first, second = lane.staging(0), lane.staging(1)
                    self._driver.copy_batch(np.array([second.data_ptr()], np.uint64),
                                            np.array([first.data_ptr()], np.uint64),
                                            np.array([min(first.numel(), 8)], np.uint64),
                                            lane.copies.cuda_stream)
                    lane.synchronize()

    # ---- the copies ---------------------------------------------------------------------
    def _block_rows(self, layout: KVLayout) -> BlockRows:
        """The layout's row pattern, uploaded on first use (one layout per KV cache group
        of the registration)."""
        cached = self._rows.get(id(layout))
        if cached is not None and cached[0] is layout:
            return cached[1]
        with self._rows_lock:
            cached = self._rows.get(id(layout))
            if cached is None or cached[0] is not layout:
                cached = (layout, BlockRows(self._span, layout.block_segments, self.device))
                self._rows[id(layout)] = cached
            return cached[1]

    def queue(self, plan: CopyPlan, hosts: HostChunks, event_handle: bytes | None,
              to_host: bool) -> torch.cuda.Event | None:
        """Queue a store's (`to_host`) or a retrieve's copies of one KV cache group from
        the calling thread, the one thread that queues on this device (its current device
        must be this copier's), and return the event recorded after them (None: nothing to
        copy). The bytes are there once the event is; the caller waits for it elsewhere,
        so this thread goes on queueing the next operation's copies behind these and the
        copy engine never idles between operations."""
        if not len(plan.block_ids):
            return None
        lane = self._store_lane if to_host else self._retrieve_lane
        return self._queue(lane, plan, hosts, event_handle, to_host)

    def _queue(self, lane: _Lane, plan: CopyPlan, hosts: HostChunks,
               event_handle: bytes | None, to_host: bool) -> torch.cuda.Event:
        """Queues the copies of one KV cache group of an operation (on the queueing
        thread) and returns the event recorded after them."""
        with lane.lock:
            if self._closed:
                raise NotRegistered("the engine unregistered while its copy was queued")
            torch.cuda.set_stream(lane.copies)
            last = lane.copies
            queued = False
            try:
                path = copy_path(plan, self.mode, to_host, self._driver is not None)
                if path == "dma":
                    self._wait_engine(lane.copies, event_handle)
                    self._copy_segments(plan, hosts, to_host)
                elif path == "batch":
                    self._wait_engine(lane.copies, event_handle)
                    self._copy_batched(plan, hosts, to_host, lane.copies)
                else:
                    last = self._copy_staged(lane, plan, hosts, to_host, event_handle)
                queued = True
            finally:
                done = torch.cuda.Event(blocking=True)  # sleeps, not spins
                if not queued:
                    # Queueing failed half way: cover whatever either stream holds, so
                    # nothing is left running once this raises (the chunks are then
                    # aborted) and neither buffer is taken before it is done.
                    joined = torch.cuda.Event()
                    joined.record(lane.kernels)
                    lane.copies.wait_event(joined)
                    last = lane.copies
                done.record(last)
                lane.ids.settle(done)
                if not queued:
                    lane.free = [done, done]
                    done.synchronize()
            return done

    def _wait_engine(self, stream: torch.cuda.Stream, event_handle: bytes | None) -> None:
        """Everything queued on `stream` from now on waits for the engine's event."""
        if not event_handle:
            return
        try:
            event = torch.cuda.Event.from_ipc_handle(self.device, event_handle)
        except RuntimeError as exc:  # torch's CUDA errors; the context stays usable
            # An event made in another IPC or PID namespace (kvdepot's worker sends none
            # from there, but any client may): this operation fails, the process lives.
            raise InvalidRequest(f"the engine's CUDA event cannot be opened in the server "
                                 f"({exc}); an engine in another PID or IPC namespace must "
                                 "wait for its work itself and send no event") from exc
        stream.wait_event(event)

    def _copy_segments(self, plan: CopyPlan, chunks: HostChunks, to_host: bool) -> None:
        engine = self.allocations
        hosts = chunks.each
        for a, e, c, w, n in plan.each_copy():
            if to_host:
                hosts[c][w:w + n].copy_(engine[a][e:e + n], non_blocking=True)
            else:
                engine[a][e:e + n].copy_(hosts[c][w:w + n], non_blocking=True)

    def _copy_batched(self, plan: CopyPlan, hosts: HostChunks, to_host: bool,
                      stream: torch.cuda.Stream) -> None:
        assert self._driver is not None
        # Driver calls need a current context, which the runtime's calls so far on this
        # thread may not have made current.
        self._driver.ensure_context(self.device.index or 0)
        arrays = batch_arrays(plan, self._engine_bases, hosts, to_host)
        for at in range(0, len(arrays[2]), BATCH_COPIES):
            self._driver.copy_batch(*(a[at:at + BATCH_COPIES] for a in arrays),
                                    stream.cuda_stream)

    def _copy_staged(self, lane: _Lane, plan: CopyPlan, hosts: HostChunks,
                     to_host: bool, event_handle: bytes | None) -> torch.cuda.Stream:
        """Queues a staged operation; returns the stream its last step is on."""
        # Everything that touches engine memory (and the index it needs) is on the kernel
        # stream, so only that stream waits for the engine's event; a retrieve's DMAs into
        # staging start without it.
        torch.cuda.set_stream(lane.kernels)
        rows = self._block_rows(plan.layout)
        index = rows.index(lane.ids.upload(plan.block_ids))
        self._wait_engine(lane.kernels, event_handle)
        stages = _Stages(lane, to_host, rows.row_bytes, self._span.base)
        staged_copy(plan, rows, index, stages, hosts, to_host, self.staging_bytes)
        return stages.last


class Stages(Protocol):
    """How `staged_copy` gets its staging buffer and orders its steps."""

    def begin(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A staging buffer of at least `nbytes`, as bytes and as span rows, free for the
        piece's first step."""

    def handoff(self) -> None:
        """Between a piece's first step and its second."""

    def end(self) -> None:
        """After a piece's second step: its buffer may be taken again once that is done."""


def staged_copy(plan: CopyPlan, rows: BlockRows, index: torch.Tensor, stages: Stages,
                hosts: HostChunks, to_host: bool, limit: int = STAGING_BYTES) -> None:
    """Queue a staged copy: per piece of whole chunks, one gather kernel from the engine's
    rows into staging, then one DMA per run of chunks adjacent in host memory (a store),
    or those DMAs, then one scatter kernel (a retrieve). Device-agnostic, so the unit
    tests run the same steps on CPU memory."""
    block_bytes = plan.layout.block_bytes
    per_block = rows.rows_per_block
    engine_rows = rows.engine_rows
    for piece in _pieces(plan.chunk_ranges(), limit):
        first, last = piece[0][3], piece[-1][4]
        staging, staged = stages.begin((last - first) * block_bytes)
        staged = staged[:(last - first) * per_block]
        piece_index = index[first * per_block:last * per_block]
        if to_host:
            torch.index_select(engine_rows, 0, piece_index, out=staged)
            stages.handoff()
        for host, block in hosts.dma_runs(piece):
            s = (block - first) * block_bytes
            if to_host:
                host.copy_(staging[s:s + host.numel()], non_blocking=True)
            else:
                staging[s:s + host.numel()].copy_(host, non_blocking=True)
        if not to_host:
            stages.handoff()
            engine_rows.index_copy_(0, piece_index, staged)
        stages.end()


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
