"""Worker-side half of the connector: submits the planned transfers and reports them.

Runs in every vLLM worker (one per GPU or CPU rank). The kvdepot server does
the copies; this side only hands over block ids, waits where vLLM's block
reuse demands it, and translates completions and failures into what vLLM's
scheduler understands.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvdepot.client.kv_export import GROUP_HINT, STATE_HINT
from kvdepot.client.worker import WorkerClient, held_blocks, written_blocks
from kvdepot.integrations.vllm import staging
from kvdepot.integrations.vllm.metadata import KVDepotConnectorMetadata, load_store_op

log = logging.getLogger(__name__)


def grouped_layers(kv_caches: dict[str, torch.Tensor], layer_groups: dict[str, int]
                   ) -> dict[str, torch.Tensor]:
    """The layers to register for an engine with several KV cache groups: those of a group,
    plus none that is in no group, unless it is another name for a grouped layer's cache
    (KV sharing between layers), which is then dropped (its bytes travel with that layer)."""
    layers = {name: t for name, t in kv_caches.items() if name in layer_groups}
    views = {(t.data_ptr(), tuple(t.shape), tuple(t.stride())) for t in layers.values()}
    for name, tensor in kv_caches.items():
        if name not in layers and (tensor.data_ptr(), tuple(tensor.shape),
                                   tuple(tensor.stride())) not in views:
            raise ValueError(f"KV cache layer {name!r} belongs to no KV cache group of vLLM's; "
                             "kvdepot cannot tell which block ids address it")
    missing = sorted(set(layer_groups.values()) - {layer_groups[name] for name in layers})
    if missing:
        # A hybrid model's attention KV without its recurrent states (or the reverse)
        # would make hits vLLM computes wrongly on.
        raise ValueError(f"KV cache group(s) {missing} of vLLM's have no layer among the KV "
                         "caches registered; kvdepot registers every group or none")
    return layers


@dataclass(frozen=True)
class StagingPlan:
    """Where and how large a staging area the worker makes (`staging`)."""

    engine_key: str
    """vLLM's engine id: the scheduler in this process finds the area under it."""
    budget_bytes: int
    make_client: Callable[[], WorkerClient]
    """A worker client of its own for the area (same server, model and rank)."""


class WorkerSide:
    """Submits one worker's stores and retrieves and collects their completions."""

    def __init__(
        self,
        client: WorkerClient,
        block_size: int,
        can_load: bool,
        can_store: bool,
        preemption_wait_s: float,
        retrieve_delay_s: float = 0.0,
        layer_groups: dict[str, int] | None = None,
        frees_blocks_early: bool = False,
        inline_load_timeout: float = 5.0,
        state_groups: tuple[int, ...] = (),
        staging_plan: StagingPlan | None = None,
    ) -> None:
        """`inline_load_timeout`: seconds a synchronous load waits for the server before
        the worker gives up on it (`WorkerClient.finish_retrieves`). `staging_plan`: make a
        staging area once the KV cache is registered; given only where the connector
        stages loads (it can load, one KV cache group, no state groups)."""
        self._client = client
        self._layer_groups = layer_groups or {}
        """Each layer's KV cache group, when vLLM made more than one."""
        self._state_groups = frozenset(state_groups)
        """The groups of recurrent layers (one state per block), registered as such."""
        self._multi_group = len(set(self._layer_groups.values())) > 1
        self._frees_early = frees_blocks_early
        """vLLM frees some group's blocks while the request runs (a sliding window)."""
        self._store_blocks: dict[str, set[int]] = {}
        """With blocks freed early: the blocks each request's unfinished stores read."""
        self._block_size = block_size
        self._can_load = can_load
        self._can_store = can_store
        self._preemption_wait_s = preemption_wait_s
        self._retrieve_delay_s = retrieve_delay_s
        self._inline_load_timeout = inline_load_timeout
        self._use_cuda_events = False
        self._delayed_free: set[str] = set()
        """Finished requests the scheduler holds blocks for; only these may be
        reported as finished sending (vLLM asserts it still knows the id)."""
        # Loads that failed here, before the client had them (planned as failed by the
        # scheduler, refused by the role, or a submit that raised): their blocks, their
        # requests for finished_recving and, with several groups, as failed by request.
        # The client reports its own failures the same way, written blocks only.
        self._local_errors: set[int] = set()
        self._local_recving: set[str] = set()
        self._local_failed: set[str] = set()
        self._kv_caches: dict[str, torch.Tensor] = {}
        """The tensors vLLM registered: sleep mode's restore registers them again."""
        self._staging_plan = staging_plan
        self._staging: staging.StagingArea | None = None
        self._asleep = False
        """Between `unregister_kv_caches` and `restore_kv_caches` (vLLM 0.33's sleep mode):
        the memory is vLLM's to release, so no transfer may be submitted."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._client.register_kv_caches(*self._registration(kv_caches))
        if self._staging_plan is not None and self._staging is None:
            self._make_staging_area(self._staging_plan, kv_caches)

    def _make_staging_area(self, plan: StagingPlan, kv_caches: dict[str, torch.Tensor]
                           ) -> None:
        client = None
        try:
            client = plan.make_client()
            area = staging.StagingArea(client, kv_caches, self._block_size, plan.budget_bytes,
                                       self._inline_load_timeout, self._retrieve_delay_s)
        except Exception:
            # Loads stay asynchronous, as without a staging area.
            log.warning("kvdepot: no staging area for this worker", exc_info=True)
            if client is not None:
                client.shutdown()
            return
        self._staging = area
        staging.publish(plan.engine_key, area)
        log.info("kvdepot: staging area of %d blocks (%.1f MiB) registered", area.slots,
                 area.nbytes / 2**20)

    def _registration(self, kv_caches: dict[str, torch.Tensor]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """(the layers to register, their layout hints) for the worker client."""
        first = next(iter(kv_caches.values()), None)
        self._use_cuda_events = first is not None and first.is_cuda
        if not self._multi_group:
            return kv_caches, None
        layers = grouped_layers(kv_caches, self._layer_groups)
        return layers, {
            GROUP_HINT: [self._layer_groups[name] for name in layers],
            STATE_HINT: [self._layer_groups[name] in self._state_groups for name in layers]}

    # ---- sleep mode (vLLM 0.33) -------------------------------------------------------
    def unregister_kv_caches(self) -> None:
        """Before vLLM releases the KV memory: drain this worker's transfers, unregister
        at the server (which then maps nothing of this worker) and drop the memory
        handles. Idempotent (vLLM's `discard` may call it while already asleep)."""
        if self._asleep:
            return
        self._asleep = True  # first: a submit racing the drain is refused, not sent
        # The area's moves target the tensors it was made for, which vLLM is releasing:
        # without it, loads are asynchronous until a restore makes a new one.
        self._close_staging_area()
        self._client.unregister_kv_caches()
        log.info("kvdepot: KV cache unregistered for sleep mode")

    def restore_kv_caches(self, kv_caches: dict[str, torch.Tensor] | None = None) -> None:
        """After vLLM mapped the KV memory again: register it with the server for the same
        model and rank. vLLM 0.33 passes nothing (its CuMem allocator maps the same
        addresses, so the tensors it registered stay valid); `kv_caches` replaces them
        where an engine allocated new ones. Addresses are read anew either way.
        Idempotent."""
        if not self._asleep:
            return
        if kv_caches is not None:
            self._kv_caches = dict(kv_caches)
        if not self._kv_caches:  # asleep before vLLM ever registered: nothing to restore
            self._asleep = False
            return
        self._client.restore_kv_caches(*self._registration(self._kv_caches))
        self._asleep = False
        log.info("kvdepot: KV cache registered again after wake-up")
        if self._staging_plan is not None and self._staging is None:
            self._make_staging_area(self._staging_plan, self._kv_caches)

    @property
    def asleep(self) -> bool:
        return self._asleep

    def on_metadata(self, meta: KVDepotConnectorMetadata) -> None:
        self._delayed_free.update(meta.delayed_free_req_ids)

    def handle_preemptions(self, meta: KVDepotConnectorMetadata) -> None:
        """Hold the step until stores reading a preempted request's blocks are done.

        vLLM frees a preempted request's blocks at once and may hand them to
        another request in this very step; a store still reading them would
        then copy the other request's KV under this request's keys.
        """
        if meta.preempted_req_ids and self._can_store:
            self._wait_for_stores(meta.preempted_req_ids)
        if meta.reused_block_ids and self._store_blocks:
            reused = set(meta.reused_block_ids)
            self._wait_for_stores([r for r, blocks in self._store_blocks.items()
                                   if not blocks.isdisjoint(reused)])

    def start_loads(self, meta: KVDepotConnectorMetadata) -> None:
        for load in meta.staged:
            if self._staging is not None:
                self._staging.move(load.first_slot, load.block_ids)
            else:
                # The area the scheduler staged it in was closed (never expected: only the
                # KV cache's release closes it, and vLLM schedules nothing around that).
                log.error("kvdepot: a staged load of request %s has no staging area left; "
                          "vLLM recomputes it", load.request_id)
                self._fail_load(load.request_id, load.block_ids, inline=True)
        self._submit_loads(meta)
        if meta.wait_for_loads:
            # Nothing computes in this step: it ends when get_finished can report them.
            self._client.wait_for_retrieves(self._inline_load_timeout)

    def _submit_loads(self, meta: KVDepotConnectorMetadata) -> None:
        inline_failed = set(meta.inline_failed_loads)
        for req_id, expected in meta.failed_loads.items():
            self._fail_load(req_id, expected, inline=req_id in inline_failed)
        if not meta.loads:
            return
        ops = [load_store_op(spec) for spec in meta.loads]
        if self._asleep:
            # vLLM pauses scheduling while asleep, so this should never come; if it does,
            # the memory is not ours to write: vLLM recomputes these blocks instead.
            log.warning("kvdepot: %d loads requested while the KV cache is unregistered "
                        "(sleep mode); vLLM will recompute them", len(ops))
            for spec, op in zip(meta.loads, ops, strict=True):
                self._fail_load(spec.request_id, written_blocks(op, self._block_size),
                                inline=spec.inline)
            return
        if not self._can_load:
            # The scheduler never plans loads for a producer; if one arrives
            # anyway, make vLLM recompute rather than wait forever.
            for spec, op in zip(meta.loads, ops, strict=True):
                self._fail_load(spec.request_id, written_blocks(op, self._block_size),
                                inline=spec.inline)
            return
        if self._retrieve_delay_s > 0:
            time.sleep(self._retrieve_delay_s)
        try:
            self._client.batched_submit_retrieve_requests(
                [spec.request_id for spec in meta.loads], ops, self._event(),
                cache_salts=[spec.cache_salt for spec in meta.loads])
        except Exception:
            log.warning("kvdepot: submitting retrieves failed; vLLM will recompute",
                        exc_info=True)
            # As the client would report them: the blocks each retrieve writes, never
            # those it shares with vLLM's prefix cache.
            for spec, op in zip(meta.loads, ops, strict=True):
                self._fail_load(spec.request_id, written_blocks(op, self._block_size),
                                inline=spec.inline)
        inline = [spec.request_id for spec in meta.loads if spec.inline]
        if inline:
            # vLLM computes these requests in this very step: their blocks must be written
            # (or reported as load errors of this step) before the forward starts.
            self._client.finish_retrieves(inline, self._inline_load_timeout)

    def submit_stores(self, meta: KVDepotConnectorMetadata) -> None:
        if not (meta.stores and self._can_store):
            return
        if self._asleep:
            # The memory may already be released: storing it would cache garbage under
            # valid keys. A skipped store is only a future miss.
            log.warning("kvdepot: %d stores requested while the KV cache is unregistered "
                        "(sleep mode); skipped", len(meta.stores))
            return
        ids = [spec.request_id for spec in meta.stores]
        ops = [load_store_op(spec) for spec in meta.stores]
        salts = [spec.cache_salt for spec in meta.stores]
        if self._frees_early:
            for spec in meta.stores:
                self._store_blocks.setdefault(spec.request_id, set()).update(
                    held_blocks(spec.block_ids))
        try:
            self._client.batched_submit_store_requests(ids, ops, self._event(), cache_salts=salts)
        except Exception:
            # A lost store is only a future cache miss.
            log.warning("kvdepot: submitting stores failed; skipping them", exc_info=True)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        try:
            sending, recving = self._client.get_finished(finished_req_ids)
        except Exception:
            log.warning("kvdepot: polling completions failed", exc_info=True)
            sending, recving = set(), set()
        sending = set(sending or ()) & self._delayed_free
        self._delayed_free -= sending
        for req_id in [r for r in self._store_blocks if not self._client.has_pending_store(r)]:
            del self._store_blocks[req_id]
        recving = set(recving or ()) | self._local_recving
        self._local_recving = set()
        return sending, recving

    def get_failed_loads(self) -> set[str]:
        """Requests whose load failed, for engines with several KV cache groups (whose
        block ids do not name one request's blocks, so vLLM takes request ids instead).
        Called right after `get_finished`, before `get_load_errors`."""
        try:
            failed = set(self._client.get_request_ids_with_load_errors())
        except Exception:
            log.warning("kvdepot: polling load errors failed", exc_info=True)
            failed = set()
        failed |= self._local_failed
        self._local_failed = set()
        return failed

    def get_load_errors(self) -> set[int]:
        """Blocks of failed loads for vLLM to recompute: only blocks a retrieve writes (the
        client's report, and `_fail_load`'s), so a block vLLM shares between requests is
        never among them."""
        try:
            errors = set(self._client.get_block_ids_with_load_errors())
        except Exception:
            log.warning("kvdepot: polling load errors failed", exc_info=True)
            errors = set()
        errors |= self._local_errors
        self._local_errors = set()
        if self._multi_group:
            # Reported by request instead (get_failed_loads): vLLM refuses block ids here.
            return set()
        # One group: vLLM never asks by request, so drop that record (it would only grow).
        self._local_failed = set()
        try:
            self._client.get_request_ids_with_load_errors()
        except Exception:
            log.warning("kvdepot: polling load errors failed", exc_info=True)
        return errors

    def _close_staging_area(self) -> None:
        if self._staging is not None and self._staging_plan is not None:
            staging.withdraw(self._staging_plan.engine_key, self._staging)
            self._staging.close()
            self._staging = None

    def shutdown(self) -> None:
        self._close_staging_area()
        try:
            self._client.shutdown()
        except Exception:
            log.warning("kvdepot: worker shutdown failed", exc_info=True)

    # ---- helpers ---------------------------------------------------------

    def _event(self) -> torch.cuda.Event | None:
        # On GPU the server must not read or write KV before the work queued
        # so far on the compute stream is done; on CPU the step is already
        # finished when vLLM calls us.
        if not self._use_cuda_events:
            return None
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream())
        return event

    def _fail_load(self, req_id: str, blocks: list[int], inline: bool = False) -> None:
        """Report a load that failed on this side: `blocks` (only those it was to write)
        as load errors and, unless it was synchronous (`inline`: the request is in this
        step's batch), the request as finished receiving (vLLM waits for that) and, for
        engines with several groups, as failed by request."""
        self._local_errors.update(blocks)
        if not inline:
            self._local_recving.add(req_id)
            self._local_failed.add(req_id)

    def _wait_for_stores(self, req_ids: list[str]) -> None:
        deadline = time.monotonic() + self._preemption_wait_s
        pending = set(req_ids)
        while True:
            pending = {r for r in pending if self._client.has_pending_store(r)}
            if not pending:
                return
            if time.monotonic() >= deadline:
                log.warning(
                    "kvdepot: stores of preempted requests %s still running after %.1f s",
                    sorted(pending), self._preemption_wait_s,
                )
                return
            time.sleep(0.001)
