"""Worker-side half of the connector: submits the planned transfers and reports them.

Runs in every vLLM worker (one per GPU or CPU rank). The kvdepot server does
the copies; this side only hands over block ids, waits where vLLM's block
reuse demands it, and translates completions and failures into what vLLM's
scheduler understands.
"""

from __future__ import annotations

import logging
import time

import torch

from kvdepot.client.engine_types import LoadStoreOp
from kvdepot.client.worker import WorkerClient
from kvdepot.integrations.vllm.metadata import KVDepotConnectorMetadata, TransferSpec
from kvdepot.protocol import NO_BLOCK

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
    return layers


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
    ) -> None:
        self._client = client
        self._layer_groups = layer_groups or {}
        """Each layer's KV cache group, when vLLM made more than one."""
        self._multi_group = len(set(self._layer_groups.values())) > 1
        self._frees_early = frees_blocks_early
        """vLLM frees some group's blocks while the request runs (a sliding window)."""
        self._store_blocks: dict[str, set[int]] = {}
        """With blocks freed early: the blocks each request's unfinished stores read."""
        self._local_failed: set[str] = set()
        self._block_size = block_size
        self._can_load = can_load
        self._can_store = can_store
        self._preemption_wait_s = preemption_wait_s
        self._retrieve_delay_s = retrieve_delay_s
        self._use_cuda_events = False
        self._delayed_free: set[str] = set()
        """Finished requests the scheduler holds blocks for; only these may be
        reported as finished sending (vLLM asserts it still knows the id)."""
        self._shared_blocks: dict[str, set[int]] = {}
        """Blocks that a retrieve must not write (shared with vLLM's prefix
        cache): they stay valid even when the retrieve fails."""
        self._retired_retrieves: list[str] = []
        self._local_errors: set[int] = set()
        self._local_recving: set[str] = set()
        """Failed blocks and finished retrieves detected here rather than by the client."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()), None)
        self._use_cuda_events = first is not None and first.is_cuda
        if not self._multi_group:
            self._client.register_kv_caches(kv_caches)
            return
        layers = grouped_layers(kv_caches, self._layer_groups)
        self._client.register_kv_caches(layers, extra_layout_hints={
            "per_layer_kv_cache_group_id": [self._layer_groups[name] for name in layers]})

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
        if not meta.loads:
            return
        if not self._can_load:
            # The scheduler never plans loads for a producer; if one arrives
            # anyway, make vLLM recompute rather than wait forever.
            for spec in meta.loads:
                self._fail_load(spec)
            return
        if self._retrieve_delay_s > 0:
            time.sleep(self._retrieve_delay_s)
        ids, ops, salts = [], [], []
        for spec in meta.loads:
            if spec.end <= spec.start:
                self._fail_load(spec)
                continue
            num_shared = -(-spec.skip_first_n_tokens // self._block_size)
            self._shared_blocks[spec.request_id] = {
                b for group in spec.block_ids for b in group[:num_shared] if b != NO_BLOCK}
            ids.append(spec.request_id)
            ops.append(self._op(spec))
            salts.append(spec.cache_salt)
        if not ids:
            return
        try:
            self._client.batched_submit_retrieve_requests(
                ids, ops, self._event(), cache_salts=salts
            )
        except Exception:
            log.warning("kvdepot: submitting retrieves failed; vLLM will recompute",
                           exc_info=True)
            for spec in meta.loads:
                if spec.end > spec.start:
                    self._fail_load(spec)

    def submit_stores(self, meta: KVDepotConnectorMetadata) -> None:
        if not (meta.stores and self._can_store):
            return
        ids = [spec.request_id for spec in meta.stores]
        ops = [self._op(spec) for spec in meta.stores]
        salts = [spec.cache_salt for spec in meta.stores]
        if self._frees_early:
            for spec in meta.stores:
                self._store_blocks.setdefault(spec.request_id, set()).update(
                    b for group in spec.block_ids for b in group)
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
        # Keep the shared-block filter of these retrieves for one more
        # error poll: vLLM reads load errors right after this call.
        self._retired_retrieves.extend(recving)
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
        try:
            errors = set(self._client.get_block_ids_with_load_errors())
        except Exception:
            log.warning("kvdepot: polling load errors failed", exc_info=True)
            errors = set()
        if self._multi_group:
            # Reported by request instead (get_failed_loads): vLLM refuses block ids here.
            errors = set()
            self._local_errors = set()
        for shared in self._shared_blocks.values():
            errors -= shared
        errors |= self._local_errors
        self._local_errors = set()
        for req_id in self._retired_retrieves:
            self._shared_blocks.pop(req_id, None)
        self._retired_retrieves = []
        return errors

    def shutdown(self) -> None:
        try:
            self._client.shutdown()
        except Exception:
            log.warning("kvdepot: worker shutdown failed", exc_info=True)

    # ---- helpers ---------------------------------------------------------

    def _op(self, spec: TransferSpec) -> LoadStoreOp:
        return LoadStoreOp(
            token_ids=spec.token_ids,
            block_ids=spec.block_ids,
            start=spec.start,
            end=spec.end,
            skip_first_n_tokens=spec.skip_first_n_tokens,
        )

    def _event(self) -> torch.cuda.Event | None:
        # On GPU the server must not read or write KV before the work queued
        # so far on the compute stream is done; on CPU the step is already
        # finished when vLLM calls us.
        if not self._use_cuda_events:
            return None
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream())
        return event

    def _fail_load(self, spec: TransferSpec) -> None:
        self._local_errors.update(b for group in spec.block_ids for b in group if b != NO_BLOCK)
        self._local_recving.add(spec.request_id)
        self._local_failed.add(spec.request_id)

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
