"""Staged loads: a hit copied into the worker's own memory before vLLM hears of it.

Under vLLM's asynchronous scheduling (its default on GPUs) a synchronous load must never
fail: vLLM schedules the request's next step before the step that loaded it reports, so a
failure reported then is not recomputed. Its asynchronous loads are safe, but cost the
engine steps that carry a finished load back to the scheduler and schedule the request.

A staged load is synchronous and cannot fail once vLLM is told of it. On an idle engine
the scheduler has the server copy the hit into a staging area, memory of the worker's own
registered with the server as a second KV cache of the same layout (so the server's
retrieve needs nothing new), waits for the copy, and only then answers vLLM that the
tokens are computed. A stage that fails leaves the load asynchronous (recomputed by
vLLM if it fails too). In the step that computes the request, the worker moves the staged blocks
into the request's blocks with a device copy on its own stream, before the forward.

The scheduler calls the staging area directly, so staging works only where the scheduler
and the worker share a process: vLLM's single-process executor (one GPU, no tensor or
pipeline parallelism). It costs one more device copy of the loaded bytes, within device
memory, and the staging area's memory.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import torch

from kvdepot.client.kv_export import infer_block_axis
from kvdepot.client.worker import WorkerClient
from kvdepot.integrations.vllm.metadata import TransferSpec, load_store_op

log = logging.getLogger(__name__)

MIN_SLOTS = 3
"""Fewer staged blocks than this are no staging area worth its connection."""

_AREAS: dict[str, StagingArea] = {}
_AREAS_LOCK = threading.Lock()


def publish(engine_key: str, area: StagingArea) -> None:
    """Make `area` the staging area of the engine `engine_key` (vLLM's engine id) for the
    scheduler of that engine in this process."""
    with _AREAS_LOCK:
        _AREAS[engine_key] = area


def find(engine_key: str) -> StagingArea | None:
    with _AREAS_LOCK:
        return _AREAS.get(engine_key)


def withdraw(engine_key: str, area: StagingArea) -> None:
    with _AREAS_LOCK:
        if _AREAS.get(engine_key) is area:
            del _AREAS[engine_key]


def mirror(tensor: torch.Tensor, block_axis: int, blocks: int) -> torch.Tensor:
    """A new tensor shaped as `tensor` but for `blocks` blocks along `block_axis`, its
    dimensions in the same order in memory (compactly), so a block's bytes lie in it as
    they lie in `tensor` and the server sees one chunk format in both."""
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), d))
    shape = list(tensor.shape)
    shape[block_axis] = blocks
    compact = torch.empty([shape[d] for d in order], dtype=tensor.dtype, device=tensor.device)
    inverse = [order.index(d) for d in range(tensor.dim())]
    return compact.permute(inverse)


def _views(kv_caches: dict[str, torch.Tensor], block_size: int
           ) -> dict[tuple, tuple[torch.Tensor, int]]:
    """Each distinct view among the layers (names may alias one), with its block axis."""
    views: dict[tuple, tuple[torch.Tensor, int]] = {}
    for name, tensor in kv_caches.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if key not in views:
            views[key] = (tensor, infer_block_axis(name, tensor, block_size))
    return views


def block_footprint(kv_caches: dict[str, torch.Tensor], block_size: int) -> tuple[int, int]:
    """(bytes of one block of every layer, blocks in the cache)."""
    views = _views(kv_caches, block_size).values()
    return (sum(t.numel() // t.shape[axis] * t.element_size() for t, axis in views),
            min(t.shape[axis] for t, axis in views))


def mirror_caches(kv_caches: dict[str, torch.Tensor], block_size: int, blocks: int
                  ) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor, int]]]:
    """A staging cache of `blocks` blocks for `kv_caches`: per layer name its staging
    tensor (aliases of one view share one, as they do in `kv_caches`), and each distinct
    view as (the view, its staging tensor, the block axis)."""
    staged: dict[tuple, torch.Tensor] = {}
    pairs = []
    for key, (tensor, axis) in _views(kv_caches, block_size).items():
        staged[key] = mirror(tensor, axis, blocks)
        pairs.append((tensor, staged[key], axis))
    return ({name: staged[(t.data_ptr(), tuple(t.shape), tuple(t.stride()))]
             for name, t in kv_caches.items()}, pairs)


Move = tuple[torch.Tensor, torch.Tensor, int]
"""One copy of a move: (destination, source, the axis of their blocks)."""

MAX_ROW_VIEWS = 8
"""Row views per layer beyond which a move copies along the block axis instead: each view
is a kernel launch of its own."""

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def move_plan(pairs: list[tuple[torch.Tensor, torch.Tensor, int]]) -> list[Move]:
    """The copies a move makes for `mirror_caches`'s pairs. Where a block's bytes form one
    dense run in the cache and in its staging tensor, per index of the dimensions laid
    out outside the block axis (K and V in vLLM's flash-attention layout), both are seen
    as `[blocks, words]` with the widest integer words they allow, and the copy runs
    along axis 0: a kernel copying whole words of whole blocks, where a copy along the
    block axis of a `bfloat16` tensor goes two bytes at a time. Otherwise the pair is
    copied as it is."""
    plan: list[Move] = []
    for cache, staged, axis in pairs:
        rows = _word_rows(cache, staged, axis)
        plan.extend(rows if rows is not None else [(cache, staged, axis)])
    return plan


def _word_rows(cache: torch.Tensor, staged: torch.Tensor, axis: int) -> list[Move] | None:
    into, out_of = _block_rows(cache, axis), _block_rows(staged, axis)
    if (into is None or out_of is None or len(into) != len(out_of)
            or len(into) > MAX_ROW_VIEWS):
        return None
    row_bytes = into[0].shape[1] * cache.element_size()
    for word, dtype in _WORDS:
        if row_bytes % word:
            continue
        try:  # a view of a wider type also needs its offset and strides aligned to it
            return [(a.view(dtype), b.view(dtype), 0) for a, b in zip(into, out_of, strict=True)]
        except RuntimeError:
            continue
    return None


def _block_rows(tensor: torch.Tensor, axis: int) -> list[torch.Tensor] | None:
    """`tensor` as `[blocks, elements]` views, one per index of the dimensions whose
    stride is larger than the block axis's; None where a block's elements within one
    such view are not one dense run."""
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), d))
    physical = tensor.permute(order)
    at = order.index(axis)
    views = []
    for index in itertools.product(*map(range, physical.shape[:at])):
        blocks = physical[index]
        if blocks.shape[0] == 0 or blocks[0].numel() == 0 or not blocks[0].is_contiguous():
            return None
        views.append(blocks.view(blocks.shape[0], -1))
    return views


def move_blocks(plan: list[Move], first_slot: int, block_ids: list[int]) -> None:
    """Copy staging slots `first_slot`, `first_slot + 1`, ... into blocks `block_ids` of
    every copy of `plan` (`move_plan`), on the current stream."""
    device = plan[0][0].device
    target = torch.tensor(block_ids, dtype=torch.long).to(device, non_blocking=True)
    for cache, staged, axis in plan:
        cache.index_copy_(axis, target, staged.narrow(axis, first_slot, len(block_ids)))


class SlotRanges:
    """Which owner holds which run of consecutive slots out of `slots`."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._runs: dict[str, tuple[int, int]] = {}
        """Each owner's run, as (first, count)."""

    def reserve(self, owner: str, count: int) -> int | None:
        """The first of `count` consecutive free slots, now `owner`'s (replacing a run it
        held); None, and nothing taken, if no such run is free."""
        self._runs.pop(owner, None)
        at = 0
        for first, taken in sorted(self._runs.values()):
            if first - at >= count:
                break
            at = max(at, first + taken)
        if count <= 0 or at + count > self.slots:
            return None
        self._runs[owner] = (at, count)
        return at

    def release(self, owner: str) -> None:
        self._runs.pop(owner, None)

    def __contains__(self, owner: str) -> bool:
        return owner in self._runs


class StagingArea:
    """Staging slots mirroring one worker's KV cache, registered over a connection of their
    own (the loads they stage report nothing to vLLM), and the slots' bookkeeping."""

    def __init__(self, client: WorkerClient, kv_caches: dict[str, torch.Tensor],
                 block_size: int, budget_bytes: int, timeout: float,
                 delay_s: float = 0.0) -> None:
        """`timeout`: how long a stage waits for the server (`WorkerClient.finish_retrieves`);
        `delay_s`: the connector's test hook `debug.retrieve_delay_s`, a wait before each
        stage is sent, as before each batch of the worker's retrieves."""
        self._client = client
        self._timeout = timeout
        self._delay_s = delay_s
        block_bytes, num_blocks = block_footprint(kv_caches, block_size)
        self.slots = min(budget_bytes // block_bytes, num_blocks)
        if self.slots < MIN_SLOTS:
            # Two would also read as a K/V dimension (`infer_block_axis`).
            raise ValueError(f"a staging area of {budget_bytes} bytes holds fewer than "
                             f"{MIN_SLOTS} blocks of {block_bytes} bytes")
        staged, pairs = mirror_caches(kv_caches, block_size, self.slots)
        self._moves = move_plan(pairs)
        client.register_kv_caches(staged)
        self.nbytes = self.slots * block_bytes
        self._cuda = next(iter(kv_caches.values())).is_cuda
        self._last_stream: torch.cuda.Stream | None = None
        """The stream the last move out of the slots ran on: a copy into them waits for it."""
        self.taken = SlotRanges(self.slots)

    # ---- slots --------------------------------------------------------------------------
    def reserve(self, owner: str, count: int) -> int | None:
        return self.taken.reserve(owner, count)

    def release(self, owner: str) -> None:
        """`owner`'s slots are free again. A move out of them queued before must still run
        first: every copy into slots waits for the stream that move ran on (`stage`)."""
        self.taken.release(owner)

    def holds(self, owner: str) -> bool:
        return owner in self.taken

    # ---- copies -------------------------------------------------------------------------
    def stage(self, spec: TransferSpec) -> bool:
        """Have the server copy `spec` (its block ids are slots this area reserved) into
        the slots; True once it has, False if it failed or the server did not answer in
        time (nothing of it is then in flight)."""
        client = self._client
        if not client.is_healthy:
            return False  # the scheduler is not held up for a server known to be down
        event = None
        if self._cuda:
            event = torch.cuda.Event(interprocess=True)
            event.record(self._last_stream or torch.cuda.current_stream())
        if self._delay_s > 0:
            time.sleep(self._delay_s)
        try:
            client.submit_retrieve_request(spec.request_id, load_store_op(spec), event,
                                           cache_salt=spec.cache_salt)
        except Exception:
            log.warning("kvdepot: staging a load failed; loading it asynchronously instead",
                        exc_info=True)
            return False
        client.finish_retrieves([spec.request_id], self._timeout)
        failed = spec.request_id in client.get_request_ids_with_load_errors()
        client.get_block_ids_with_load_errors()  # this area's slots: not vLLM's to see
        return not failed

    def move(self, first_slot: int, block_ids: list[int]) -> None:
        """Queue the copy of slots `first_slot`, `first_slot + 1`, ... into KV cache blocks
        `block_ids` on the current stream, where the step's forward runs after it."""
        if not block_ids:
            return
        move_blocks(self._moves, first_slot, block_ids)
        if self._cuda:
            self._last_stream = torch.cuda.current_stream()

    def close(self) -> None:
        try:
            self._client.shutdown()
        except Exception:
            log.warning("kvdepot: closing the staging area failed", exc_info=True)
