"""The worker-side client: registers the worker's KV memory and submits stores/retrieves.

The server does every copy. Submits return at once; `get_finished` polls. Bookkeeping
follows the contract: a request is reported in `finished_sending` once, after the engine
listed it as finished and every store it submitted is done; every retrieve is reported
in `finished_recving`, failed ones with their blocks in `get_block_ids_with_load_errors`.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections import OrderedDict
from typing import Any

import torch

from kvdepot.client.depot_client import DepotClient
from kvdepot.client.engine_types import LoadStoreOp
from kvdepot.client.kv_export import export_kv_caches
from kvdepot.errors import KVDepotError, NotRegistered, ServerUnavailable
from kvdepot.protocol import (
    RegisterKVCache,
    RequestType,
    Retrieve,
    Store,
    UnregisterKVCache,
    pack_ints,
)
from kvdepot.rpc.future import ReplyFuture

log = logging.getLogger(__name__)

RETURNED_FINISHED_MEMORY = 65536
"""How many reported request ids are remembered to suppress duplicate reports."""


def _event_handle(event: Any) -> bytes | None:
    """The IPC handle of an engine's CUDA event (None for CPU engines)."""
    if event is None:
        return None
    return bytes(event.ipc_handle())


class WorkerClient(DepotClient):
    def __init__(self, *args, **kwargs) -> None:  # same arguments as DepotClient
        super().__init__(*args, **kwargs)
        self.instance_id = 0
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._registration: RegisterKVCache | None = None
        self.store_futures: dict[str, list[ReplyFuture]] = {}
        self.retrieve_futures: dict[str, list[tuple[ReplyFuture, list[int]]]] = {}
        self.error_block_ids: set[int] = set()
        self.finished_stores: set[str] = set()
        """Requests whose stores are all done but the engine has not finished yet."""
        self.previously_finished: set[str] = set()
        """Requests the engine finished while their stores were still running."""
        # Ids already reported in finished_sending (vLLM may list a finished id again
        # with async scheduling). Only recent ids matter, so the oldest are forgotten.
        self._returned_finished: OrderedDict[str, None] = OrderedDict()
        self._events_in_flight: list[tuple[ReplyFuture, Any]] = []
        """The engine's CUDA events of operations still running: the server opens an
        event by its IPC handle, which is only valid while the event object exists, and
        an engine may drop its reference as soon as the submit returns."""

    @property
    def worker_id(self) -> int:
        return self.parallel_strategy.kv_worker_id

    @property
    def use_mla(self) -> bool:
        return self.parallel_strategy.use_mla

    @property
    def is_first_rank_of_pp_group(self) -> bool:
        """With MLA only this rank stores: the other TP ranks hold identical KV."""
        ps = self.parallel_strategy
        return ps.actual_worker_id % ps.tp_size == 0

    # ---- registration -------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Share every layer's KV memory with the server; returns once it is mapped."""
        handles, layers = export_kv_caches(kv_caches, self.block_size)
        self.kv_caches = dict(kv_caches)
        self._registration = RegisterKVCache(
            instance_id=0, model=self.model_name, world_size=self.world_size,
            rank=self.worker_id, block_size=self.block_size, allocations=handles,
            layers=layers, engine_pid=os.getpid())
        try:
            self._register()
        except (TimeoutError, ServerUnavailable) as exc:
            raise ConnectionError(f"kvdepot server at {self.mq_client.url} did not accept the "
                                  f"KV cache registration: {exc}") from None

    def _register(self) -> None:
        assert self._registration is not None
        # A fresh id per registration: a request addressed to an older registration can
        # never write into this one's memory.
        self._registration.instance_id = secrets.randbits(63)
        self._request(RequestType.REGISTER_KV_CACHE, self._registration)
        self.instance_id = self._registration.instance_id

    def _on_server_back(self, boot_id: str) -> bool:
        if self._registration is None or boot_id == self._boot_id:
            return True
        try:
            self._register()
        except (KVDepotError, TimeoutError, ConnectionError) as exc:
            log.warning("re-registering the KV cache with the restarted server failed: %s", exc)
            return False
        self._boot_id = boot_id
        log.info("re-registered the KV cache with the restarted kvdepot server")
        return True

    # ---- submits --------------------------------------------------------------------
    def _op_fields(self, request_id: str, op: LoadStoreOp, event: Any, cache_salt: str
                   ) -> dict[str, Any]:
        return dict(instance_id=self.instance_id, request_id=request_id,
                    token_ids=pack_ints(op.token_ids[:op.end]), start=op.start, end=op.end,
                    block_ids=pack_ints(op.block_ids), cache_salt=cache_salt,
                    event_handle=_event_handle(event))

    def submit_store_request(self, request_id: str, op: LoadStoreOp, event: Any,
                             cache_salt: str = "") -> None:
        """Copy `op`'s blocks into the cache once `event` (None on CPU) has completed."""
        self._ensure_heartbeat_started()
        if not self.is_healthy:
            return
        future = self.mq_client.submit(
            RequestType.STORE, Store(**self._op_fields(request_id, op, event, cache_salt)))
        self.store_futures.setdefault(request_id, []).append(future)
        if event is not None:
            self._events_in_flight.append((future, event))

    def submit_retrieve_request(self, request_id: str, op: LoadStoreOp, event: Any,
                                cache_salt: str = "") -> None:
        """Copy cached chunks into `op`'s blocks, leaving the first `skip_first_n_tokens`."""
        self._ensure_heartbeat_started()
        if not self.is_healthy:
            self.error_block_ids.update(op.block_ids)
            future: ReplyFuture = ReplyFuture()
            future.set_exception(ServerUnavailable("kvdepot server is unhealthy"))
        else:
            future = self.mq_client.submit(RequestType.RETRIEVE, Retrieve(
                skip_first_n_tokens=op.skip_first_n_tokens,
                **self._op_fields(request_id, op, event, cache_salt)))
            if event is not None:
                self._events_in_flight.append((future, event))
        self.retrieve_futures.setdefault(request_id, []).append((future, list(op.block_ids)))

    def batched_submit_store_requests(self, request_ids: list[str], ops: list[LoadStoreOp],
                                      event: Any, cache_salts: list[str] | None = None) -> None:
        salts = cache_salts if cache_salts is not None else [""] * len(request_ids)
        for request_id, op, salt in zip(request_ids, ops, salts, strict=True):
            self.submit_store_request(request_id, op, event, cache_salt=salt)

    def batched_submit_retrieve_requests(self, request_ids: list[str], ops: list[LoadStoreOp],
                                         event: Any, cache_salts: list[str] | None = None
                                         ) -> None:
        salts = cache_salts if cache_salts is not None else [""] * len(request_ids)
        for request_id, op, salt in zip(request_ids, ops, salts, strict=True):
            self.submit_retrieve_request(request_id, op, event, cache_salt=salt)

    # ---- completion -------------------------------------------------------------------
    def has_pending_store(self, request_id: str) -> bool:
        """Whether a store of `request_id` is still copying out of the engine's blocks
        (the engine must not reuse those blocks until it is done)."""
        return any(not f.done() for f in self.store_futures.get(request_id, ()))

    def _collect_stores(self, drain: bool) -> set[str]:
        done: set[str] = set()
        for request_id, futures in list(self.store_futures.items()):
            if not drain and not all(f.done() for f in futures):
                continue
            for future in futures:
                error = future.exception() if future.done() else None
                if isinstance(error, NotRegistered):
                    self._mark_unhealthy("the server no longer knows this worker's KV cache")
                elif error is not None:
                    log.error("store for request %s failed: %s", request_id, error)
            del self.store_futures[request_id]
            done.add(request_id)
        return done

    def _collect_retrieves(self, drain: bool) -> set[str]:
        done: set[str] = set()
        for request_id, entries in list(self.retrieve_futures.items()):
            if not drain and not all(f.done() for f, _ in entries):
                continue
            for future, block_ids in entries:
                error = future.exception() if future.done() else ServerUnavailable("drained")
                if error is not None:
                    if isinstance(error, NotRegistered):
                        self._mark_unhealthy("the server no longer knows this worker's KV cache")
                    log.warning("load for request %s failed, its %d blocks will be recomputed: "
                                "%s", request_id, len(block_ids), error)
                    self.error_block_ids.update(block_ids)
            del self.retrieve_futures[request_id]
            done.add(request_id)
        return done

    def get_finished(self, finished_req_ids_from_engine: set[str]
                     ) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving); never blocks.

        When the server is unhealthy, pending operations are drained: their requests are
        reported finished and drained retrieves' blocks become load errors.
        """
        drain = not self.is_healthy
        if self._events_in_flight:
            self._events_in_flight = [(f, e) for f, e in self._events_in_flight
                                      if not f.done()]
        finished_recving = self._collect_retrieves(drain)
        self.finished_stores |= self._collect_stores(drain)
        finished_sending: set[str] = set()
        for request_id in finished_req_ids_from_engine:
            if request_id in self._returned_finished:
                continue
            if request_id in self.finished_stores or request_id in self.store_futures:
                self.previously_finished.add(request_id)
            else:
                finished_sending.add(request_id)
        ready = self.finished_stores & self.previously_finished
        self.finished_stores -= ready
        self.previously_finished -= ready
        finished_sending |= ready
        # A request reported in finished_recving is deleted by the scheduler right away;
        # it must not also appear in finished_sending.
        finished_sending -= finished_recving
        for request_id in finished_sending:
            self._returned_finished[request_id] = None
        while len(self._returned_finished) > RETURNED_FINISHED_MEMORY:
            self._returned_finished.popitem(last=False)
        return finished_sending, finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.error_block_ids = self.error_block_ids, set()
        return errors

    def shutdown(self) -> None:
        if self.instance_id and self.mq_client.connected:
            try:
                self._request(RequestType.UNREGISTER_KV_CACHE,
                              UnregisterKVCache(self.instance_id), timeout=5.0)
            except (KVDepotError, TimeoutError, ConnectionError) as exc:
                log.warning("unregistering from the kvdepot server failed: %s", exc)
        if any(t.is_cuda for t in self.kv_caches.values()):
            # The server has let go of the KV memory; what torch kept of it for the server
            # (CUDA IPC reference counting) is freed only here or at process exit.
            torch.cuda.ipc_collect()
        self.close()
