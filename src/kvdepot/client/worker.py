"""The worker-side client: registers the worker's KV memory and submits stores/retrieves.

The server does every copy. Submits return at once; `get_finished` polls. Bookkeeping
follows the contract: a request is reported in `finished_sending` once, after the engine
listed it as finished and every store it submitted is done; every retrieve is reported
in `finished_recving`, failed ones with their blocks in `get_block_ids_with_load_errors`.

An operation counts as done or failed only once it is resolved: its reply came, or the
worker gave up on it (server unhealthy, connection lost) and its fence
(`kvdepot.transfer.fence`) settled it. Until then its blocks stay the server's, even
while the client is degraded: a store is not reported finished (vLLM would reuse the
blocks) and a retrieve is not reported failed (vLLM would recompute into them).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvdepot.client.depot_client import DepotClient
from kvdepot.client.engine_types import LoadStoreOp
from kvdepot.client.kv_export import export_kv_caches, layer_groups, layer_states
from kvdepot.client.memory_handover import HandoverFiles, hand_over_to
from kvdepot.errors import KVDepotError, NotRegistered, ServerError, ServerUnavailable
from kvdepot.options import DEFAULTS
from kvdepot.protocol import (
    NO_BLOCK,
    RegisterKVCache,
    RequestType,
    Retrieve,
    Store,
    UnregisterKVCache,
    ipc_namespace_id,
    pack_ints,
)
from kvdepot.rpc.future import ReplyFuture
from kvdepot.transfer.fence import ClientFence, Resolution

log = logging.getLogger(__name__)

RETURNED_FINISHED_MEMORY = 65536
"""How many reported request ids are remembered to suppress duplicate reports."""


def held_blocks(groups: Iterable[Iterable[int]]) -> list[int]:
    """Every block id of every KV cache group, in order, with the `NO_BLOCK` entries (blocks
    the engine does not hold: a sliding window's before the window) left out.

    The one place that flattens per-group block lists; the vLLM connector uses it too."""
    # int(): engines may hand numpy or tensor scalars, which would not hash as block ids.
    return [int(b) for group in groups for b in group if b != NO_BLOCK]


def written_blocks(op: LoadStoreOp, block_size: int) -> list[int]:
    """The blocks a retrieve of `op` writes, so the only ones its failure may invalidate.

    Per group, the server writes from the first block past the range's leading
    `skip_first_n_tokens` tokens (the engine shares those blocks with its prefix cache, and
    other requests may be reading them) to the one holding token `end - 1`; ids listed past
    that and unheld entries are never touched. The skip is floored to whole blocks, exactly
    as the server plans the copy: a block it would write part of is one the engine expects
    loaded."""
    first = max(0, op.skip_first_n_tokens) // block_size
    stop = -(-op.end // block_size) - op.start // block_size
    return held_blocks(group if number in op.state_groups else group[first:stop]
                       for number, group in enumerate(op.group_block_ids()))


@dataclass(eq=False)
class _Operation:
    """A store or retrieve submitted to the server, until it is resolved."""

    future: ReplyFuture
    slot: int | None
    """Its fence slot (None: never sent)."""
    generation: int
    written: list[int]
    """The engine blocks it writes (a retrieve's, see `written_blocks`; none for a store):
    exactly those become load errors when it fails."""
    event: Any = None
    """The engine's CUDA event: the server opens it by its IPC handle, which is only valid
    while the event object exists, and an engine may drop it as soon as the submit returns."""
    resolved: bool = False
    error: BaseException | None = None
    """Why it failed, once resolved (None: it succeeded)."""
    waited: bool = False
    """An idle step has waited for its reply already (`wait_for_retrieves`)."""


class WorkerClient(DepotClient):
    def __init__(self, *args, **kwargs) -> None:  # same arguments as DepotClient
        super().__init__(*args, **kwargs)
        self.instance_id = b""
        """The server's id of this worker's registration, valid on this worker's I/O
        connection only (so the worker registers over that connection)."""
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._cuda_aliases: list[torch.UntypedStorage] = []
        """What the KV cache's CUDA memory was exported through (`kv_export`): dropped only
        once the server has unmapped it."""
        self._registration: RegisterKVCache | None = None
        self._files = HandoverFiles()
        self._registration_lost = False
        """The server dropped the registration or the connection it was bound to."""
        self._events_shared = True
        """The server can open this process's CUDA events: it runs in the same IPC and PID
        namespaces (`_register` finds out)."""
        self._event_waiter: ThreadPoolExecutor | None = None
        """Where operations wait for their events when the server cannot (`_send_after`)."""
        self.mq_client.on_disconnect.insert(0, self._lose_registration)
        self._fence: ClientFence | None = None
        self.store_ops: dict[str, list[_Operation]] = {}
        self.retrieve_ops: dict[str, list[_Operation]] = {}
        self.error_block_ids: set[int] = set()
        self.failed_retrieve_requests: set[str] = set()
        """Requests with a failed retrieve, not yet taken by `get_request_ids_with_load_errors`."""
        self.finished_stores: set[str] = set()
        """Requests whose stores are all done but the engine has not finished yet."""
        self.previously_finished: set[str] = set()
        """Requests the engine finished while their stores were still running."""
        # Ids already reported in finished_sending (vLLM may list a finished id again
        # with async scheduling). Only recent ids matter, so the oldest are forgotten.
        self._returned_finished: OrderedDict[str, None] = OrderedDict()

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
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor],
                           extra_layout_hints: dict[str, Any] | None = None) -> None:
        """Share every layer's KV memory with the server; returns once it is mapped.

        `extra_layout_hints` (the keyword newer engines pass) may name each layer's KV
        cache group, `per_layer_kv_cache_group_id` (a list in `kv_caches` order), and its
        `per_layer_logical_block_size`, which must be this worker's block size, and which
        hold recurrent states (`kv_export.STATE_HINT`); other hints are ignored."""
        groups = layer_groups(kv_caches, self.block_size, extra_layout_hints)
        states = layer_states(kv_caches, extra_layout_hints)
        self._files.close()  # an earlier registration's memfds (still mapped where in use)
        self._files = HandoverFiles()
        try:
            handles, layers, self._cuda_aliases = export_kv_caches(
                kv_caches, self.block_size, self._files, groups, states)
        except BaseException:
            self._files.close()
            raise
        self.kv_caches = dict(kv_caches)
        if self._fence is None:
            self._fence = ClientFence()
        self._registration = RegisterKVCache(
            model=self.model_name, world_size=self.world_size, rank=self.worker_id,
            block_size=self.block_size, allocations=handles, layers=layers,
            engine_pid=os.getpid(), fence=self._files.add(self._fence.fd, self._fence.nbytes))
        try:
            self._register()
        except (TimeoutError, ServerUnavailable) as exc:
            raise ConnectionError(f"kvdepot server at {self.mq_client.url} did not accept the "
                                  f"KV cache registration: {exc}") from None

    def _register(self) -> None:
        """Hand the memory and the fence over (their descriptors, under a one-time ticket),
        then register on the I/O thread's connection, the one stores and retrieves use:
        the server binds the registration to it."""
        assert self._registration is not None
        # The handover address changes when the server restarts: ask the one running now.
        server = self._request(RequestType.PING)
        handed = hand_over_to(server, self.mq_client.credential, self._files.fds,
                              self._mq_timeout, self.mq_client.url)
        # The pid as the server's kernel sees this process (0 from another PID namespace).
        self._registration.handover_ticket, self._registration.engine_pid = handed
        shared = bool(handed[1]) and server.ipc_namespace in (0, ipc_namespace_id())
        if not shared and self._events_shared and any(
                t.is_cuda for t in self.kv_caches.values()):
            log.info("the kvdepot server runs in another PID or IPC namespace, where this "
                     "engine's CUDA events cannot be opened: the worker waits for each one "
                     "itself, off the engine's thread, before it sends a store or retrieve")
        self._events_shared = shared
        self._registration.replaces = self.instance_id
        self._registration_lost = False
        try:
            registered = self.mq_client.submit(RequestType.REGISTER_KV_CACHE,
                                               self._registration).result(self._mq_timeout)
        except (TimeoutError, ServerUnavailable) as exc:
            self._registration_lost = True
            self._mark_unhealthy(f"REGISTER_KV_CACHE failed ({exc})")
            raise
        self.instance_id = registered.instance_id

    def _lose_registration(self) -> None:
        self._registration_lost = True

    def _on_server_back(self, boot_id: str) -> bool:
        if self._registration is None or (boot_id == self._boot_id
                                          and not self._registration_lost):
            return True
        try:
            self._register()
        except (KVDepotError, TimeoutError, ConnectionError) as exc:
            log.warning("re-registering the KV cache with the restarted server failed: %s", exc)
            return False
        restarted = boot_id != self._boot_id
        self._boot_id = boot_id
        log.info("re-registered the KV cache with the %s kvdepot server",
                 "restarted" if restarted else "reconnected")
        return True

    # ---- sleep mode -----------------------------------------------------------------
    # vLLM 0.33's sleep mode releases the engine's KV memory and maps new memory on wake-up
    # (the same addresses with its CuMem allocator, but new physical pages). The server
    # maps the old memory through this registration's handles, so it must let go of them
    # before the engine releases the memory, and get handles of the new memory afterwards.
    def unregister_kv_caches(self, drain_timeout: float | None = None) -> bool:
        """Let go of the KV memory: wait up to `drain_timeout` (default: the client's
        request limit) for the stores and retrieves in flight, unregister at the server
        (it replies once it has unmapped the memory and the fence), then drop the memory
        handles, their descriptors, the fence and the tensors. Idempotent.

        Operations still unresolved then are settled as failed: the server no longer
        touches the memory. Until `restore_kv_caches`, every submit fails here without
        being sent (no fence). Returns whether the server confirmed the unregistration."""
        if self._registration is None:
            return True
        limit = self._mq_timeout if drain_timeout is None else drain_timeout
        deadline = time.monotonic() + limit
        while not self._resolved(self._pending_operations(), not self.is_healthy):
            if time.monotonic() >= deadline:
                log.warning("kvdepot: %d transfers still in flight after %.1f s; "
                            "unregistering anyway", len(self._pending_operations()), limit)
                break
            time.sleep(0.001)
        # Neither the heartbeat nor a lost connection may register the old memory again.
        self._registration = None
        confirmed = self._unregister_at_server()
        for operation in self._pending_operations():
            # Its fence goes below: nothing to release; the server holds no mapping.
            operation.resolved = True
            operation.event = None
            operation.error = ServerUnavailable("the KV cache was unregistered (sleep mode) "
                                                "before this transfer finished")
        self._release_memory()
        self.instance_id = b""
        self._registration_lost = False
        self.kv_caches = {}
        if self._fence is not None:
            self._fence.close()
            self._fence = None
        return confirmed

    def restore_kv_caches(self, kv_caches: dict[str, torch.Tensor],
                          extra_layout_hints: dict[str, Any] | None = None) -> None:
        """Register the (re-mapped or new) KV memory again after `unregister_kv_caches`,
        for the same model and rank, reading each tensor's address anew. The cache keys
        do not name the registration, so chunks stored before stay hits.

        A server that cannot take it now does not fail the engine's wake-up: the client
        turns degraded (loads recomputed, stores skipped) and the heartbeat registers
        the memory once the server answers."""
        # Set before registering: if the server is unreachable, the heartbeat's
        # `_on_server_back` must see a registration it still has to make.
        self._registration_lost = True
        try:
            self.register_kv_caches(kv_caches, extra_layout_hints)
        except ConnectionError as exc:
            self._mark_unhealthy(f"registering the KV cache after wake-up failed ({exc})")

    def _pending_operations(self) -> list[_Operation]:
        return [op for ops in (*self.store_ops.values(), *self.retrieve_ops.values())
                for op in ops if not op.resolved]

    def _unregister_at_server(self) -> bool:
        """Drop this worker's registration at the server; True once it confirmed (it
        replies after it has unmapped the KV memory and the fence)."""
        if not (self.instance_id and self.mq_client.connected):
            return False
        try:
            # On the I/O connection: only the connection that registered may unregister.
            self.mq_client.submit(RequestType.UNREGISTER_KV_CACHE,
                                  UnregisterKVCache(self.instance_id)).result(
                min(self._mq_timeout, DEFAULTS.unregister_timeout))
        except (KVDepotError, TimeoutError, ConnectionError) as exc:
            log.warning("unregistering from the kvdepot server failed: %s", exc)
            return False
        return True

    def _release_memory(self) -> None:
        """Drop the CUDA aliases and close the memfds the registration handed over."""
        if self._cuda_aliases:
            # Torch now sees the exports unmapped (unless unregistering failed: then it
            # keeps them until exit, and says so) and forgets them here, so the process
            # exits without its warning about shared CUDA tensors.
            self._cuda_aliases = []
            torch.cuda.ipc_collect()
        self._files.close()

    # ---- submits --------------------------------------------------------------------
    def _submit(self, request_type: RequestType, message_type: type[Store] | type[Retrieve],
                request_id: str, op: LoadStoreOp, event: Any, cache_salt: str,
                written: list[int], **extra: Any) -> _Operation:
        groups = op.group_block_ids()
        armed = self._fence.begin() if self._fence is not None else None
        if armed is None:
            future: ReplyFuture = ReplyFuture()
            future.set_exception(ServerUnavailable(
                "no fence slot is free (too many operations in flight)" if self._fence
                else "the KV cache is not registered"))
            return _Operation(future, None, 0, written)
        slot, generation = armed
        # Keys are per whole chunk or tail: a retrieve ending inside one still names its
        # tokens.
        cs = self.chunk_size
        token_end = ((max(op.end - 1, op.start) // cs * cs + op.tail_tokens) if op.tail_tokens
                     else -(-op.end // cs) * cs)
        try:
            message = message_type(
                instance_id=self.instance_id, request_id=request_id,
                token_ids=pack_ints(op.token_ids[:token_end]), start=op.start, end=op.end,
                block_ids=pack_ints(groups[0]),
                group_block_ids=[pack_ints(group) for group in groups[1:]],
                cache_salt=cache_salt,
                event_handle=bytes(event.ipc_handle()) if self._sends_event(event) else None,
                fence_slot=slot,
                fence_generation=generation, tail_tokens=op.tail_tokens,
                with_state=bool(op.state_groups), **extra)
            if event is not None and not self._events_shared:
                future = self._send_after(event, request_type, message)
            else:
                future = self.mq_client.submit(request_type, message)
        except Exception as exc:  # nothing was sent: fail the operation, free its slot
            self._fence.release(slot)
            failed: ReplyFuture = ReplyFuture()
            failed.set_exception(exc)
            return _Operation(failed, None, 0, written)
        return _Operation(future, slot, generation, written, event)

    def _sends_event(self, event: Any) -> bool:
        """Whether the server gets `event`'s IPC handle to wait on (None: a CPU engine)."""
        return event is not None and self._events_shared

    def _send_after(self, event: Any, request_type: RequestType, message: Store | Retrieve
                    ) -> ReplyFuture:
        """Send `message` once the engine's `event` has completed, for a server that cannot
        open the event (another PID or IPC namespace): one thread waits for the events in
        order and sends, so the engine's thread never waits for its own GPU work. The
        operation's fence slot is armed already: given up before it is sent, it is
        cancelled, and the server moves no byte of it."""
        reply: ReplyFuture = ReplyFuture()
        if self._event_waiter is None:
            self._event_waiter = ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix="kvdepot-events")

        def send() -> None:
            try:
                event.synchronize()
                sent = self.mq_client.submit(request_type, message)
            except Exception as exc:
                reply.set_exception(exc)
                return
            sent.add_done_callback(lambda done: reply.set_exception(done.exception())
                                   if done.exception() is not None
                                   else reply.set_result(done.result()))

        self._event_waiter.submit(send)
        return reply

    def submit_store_request(self, request_id: str, op: LoadStoreOp, event: Any,
                             cache_salt: str = "") -> None:
        """Copy `op`'s blocks into the cache once `event` (None on CPU) has completed."""
        self._ensure_heartbeat_started()
        if not self.is_healthy:
            return
        # A failed store leaves the engine's blocks as they were: it invalidates none.
        hashes = ({"block_hashes": op.block_hashes, "hash_block_size": op.hash_block_size}
                  if op.block_hashes else {})
        operation = self._submit(RequestType.STORE, Store, request_id, op, event, cache_salt,
                                 written=[], **hashes)
        self.store_ops.setdefault(request_id, []).append(operation)

    def submit_retrieve_request(self, request_id: str, op: LoadStoreOp, event: Any,
                                cache_salt: str = "") -> None:
        """Copy cached chunks into `op`'s blocks, leaving the first `skip_first_n_tokens`.

        If it fails, only the blocks it writes (`written_blocks`) are reported as load
        errors: a block it skips is shared with the engine's prefix cache and stays valid."""
        self._ensure_heartbeat_started()
        written = written_blocks(op, self.block_size)
        if not self.is_healthy:
            future: ReplyFuture = ReplyFuture()
            future.set_exception(ServerUnavailable("kvdepot server is unhealthy"))
            operation = _Operation(future, None, 0, written)
        else:
            operation = self._submit(RequestType.RETRIEVE, Retrieve, request_id, op, event,
                                     cache_salt, written,
                                     skip_first_n_tokens=op.skip_first_n_tokens)
        self.retrieve_ops.setdefault(request_id, []).append(operation)

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
    def _resolve(self, operation: _Operation, give_up: bool) -> bool:
        """Whether `operation` is resolved (its outcome in `.error`); never blocks.

        A reply resolves it: the server answers only after it has let go of the blocks.
        Without one, and once the worker gives up (`give_up`, or the request failed on
        this side of the connection), the fence decides; while the server holds the
        slot, the operation stays unresolved.
        """
        if operation.resolved:
            return True
        future = operation.future
        error = future.exception()
        if future.done() and not isinstance(error, ServerUnavailable):
            operation.error = error  # the server's own answer
        elif not (give_up or future.done()):
            return False
        elif operation.slot is not None:
            assert self._fence is not None
            outcome = self._fence.try_cancel(operation.slot, operation.generation)
            if outcome is Resolution.BUSY:
                return False
            if outcome is Resolution.DONE:
                operation.error = None
            elif outcome is Resolution.FAILED:
                operation.error = ServerError("the server failed the operation (its reply was "
                                              "lost)")
            else:
                operation.error = error or ServerUnavailable(
                    "given up: the server did not answer in time; it will not run it")
        else:
            operation.error = error
        if operation.slot is not None:
            assert self._fence is not None
            self._fence.release(operation.slot)
        operation.resolved = True
        operation.event = None
        if isinstance(operation.error, NotRegistered):
            self._registration_lost = True
            self._mark_unhealthy("the server no longer knows this worker's KV cache")
        return True

    def _resolved(self, operations: list[_Operation], give_up: bool) -> bool:
        # Every operation is visited, so each one's fence is settled as early as possible.
        return all([self._resolve(op, give_up) for op in operations])

    def has_pending_store(self, request_id: str) -> bool:
        """Whether a store of `request_id` may still copy out of the engine's blocks
        (the engine must not reuse those blocks until it is done)."""
        operations = self.store_ops.get(request_id)
        return bool(operations) and not self._resolved(operations, not self.is_healthy)

    def _collect_stores(self, give_up: bool) -> set[str]:
        done: set[str] = set()
        for request_id, operations in list(self.store_ops.items()):
            if not self._resolved(operations, give_up):
                continue
            for operation in operations:
                if operation.error is not None:
                    log.error("store for request %s failed: %s", request_id, operation.error)
            del self.store_ops[request_id]
            done.add(request_id)
        return done

    def _collect_retrieves(self, give_up: bool, request_ids: Iterable[str] | None = None
                           ) -> set[str]:
        done: set[str] = set()
        ids = list(self.retrieve_ops) if request_ids is None else request_ids
        for request_id in ids:
            operations = self.retrieve_ops.get(request_id)
            if operations is None or not self._resolved(operations, give_up):
                continue
            for operation in operations:
                if operation.error is not None:
                    log.warning("load for request %s failed, its %d blocks will be recomputed: "
                                "%s", request_id, len(operation.written), operation.error)
                    self.error_block_ids.update(operation.written)
                    self.failed_retrieve_requests.add(request_id)
            del self.retrieve_ops[request_id]
            done.add(request_id)
        return done

    def finish_retrieves(self, request_ids: Iterable[str], timeout: float) -> None:
        """Wait until the retrieves of `request_ids` are resolved: synchronous loads, whose
        blocks the engine computes on right after. Their failures become load errors at
        once (`get_block_ids_with_load_errors`); `get_finished` never reports them.

        Waits up to `timeout` for the server's replies, then gives up as `get_finished`
        does with an unhealthy server: a retrieve the server has not started is cancelled
        (a load error), and one it is copying is waited for, since the engine must not
        compute on blocks still being written.
        """
        ids = [request_id for request_id in request_ids if request_id in self.retrieve_ops]
        operations = [operation for request_id in ids
                      for operation in self.retrieve_ops[request_id]]
        deadline = time.monotonic() + timeout
        for operation in operations:
            operation.future.wait(max(0.0, deadline - time.monotonic()))
        copying_since = time.monotonic()
        warned = False
        while not self._resolved(operations, give_up=True):
            if not warned and time.monotonic() - copying_since > timeout:
                log.warning("synchronous load of %s: the server holds it mid-copy; the engine "
                            "waits for the copy to end", ids)
                warned = True
            time.sleep(0.001)
        self._collect_retrieves(give_up=True, request_ids=ids)

    def wait_for_retrieves(self, timeout: float) -> None:
        """Wait up to `timeout` for the server's replies to the pending retrieves; they stay
        pending for `get_finished` to collect, whatever the replies say. Each is waited for
        once: a server too slow for one wait is polled as before, so a stall costs an idle
        engine one wait per load, not one per step; none at all once found unhealthy."""
        if not self.is_healthy:
            return
        deadline = time.monotonic() + timeout
        for operations in list(self.retrieve_ops.values()):
            for operation in operations:
                if not operation.waited:
                    operation.waited = True
                    operation.future.wait(max(0.0, deadline - time.monotonic()))

    def get_finished(self, finished_req_ids_from_engine: set[str]
                     ) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving); never blocks.

        When the server is unhealthy the worker gives up on pending operations: each is
        reported once its fence settles it (cancelled ones as finished stores that stored
        nothing and as load errors), which is at once unless the server is copying it.
        """
        if self._registration_lost and self.is_healthy:
            # A heartbeat in flight when the registration was lost may have set the
            # client healthy again: have it look once more (and register again).
            self._mark_unhealthy("this worker's KV cache registration was lost")
        give_up = not self.is_healthy
        finished_recving = self._collect_retrieves(give_up)
        self.finished_stores |= self._collect_stores(give_up)
        finished_sending: set[str] = set()
        for request_id in finished_req_ids_from_engine:
            if request_id in self._returned_finished:
                continue
            if request_id in self.finished_stores or request_id in self.store_ops:
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

    def get_request_ids_with_load_errors(self) -> set[str]:
        """Requests reported in `finished_recving` whose retrieve failed (for engines whose
        block ids do not name a request's blocks alone: several KV cache groups)."""
        failed, self.failed_retrieve_requests = self.failed_retrieve_requests, set()
        return failed

    def shutdown(self) -> None:
        if self._event_waiter is not None:
            self._event_waiter.shutdown(wait=True, cancel_futures=False)
        self._unregister_at_server()
        self._release_memory()
        self.close()
        if self._fence is not None:
            self._fence.close()
