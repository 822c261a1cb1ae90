"""The depot: dispatches each request type to its handler, and runs the server's life.

Stores and retrieves go to the data path (`data_path.py`), lookups and their locks to the
control path (`control_path.py`), registrations to the engine registry; tenant
administration is `tenants.py`; all of them are built by `assembly.py`. What stays here:
which thread runs what, refusals while draining, admin-only requests, reaping dead
engines, expiring locks and shutting down in order."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvdepot.errors import InvalidRequest, KVDepotError, PermissionDenied, UnknownRequestType
from kvdepot.log_limiter import LogLimiter
from kvdepot.metrics import MetricsRegistry
from kvdepot.options import Options
from kvdepot.protocol import (
    REQUESTS,
    Message,
    Pong,
    Registered,
    RegisterKVCache,
    ReportBlockAllocation,
    RequestType,
    Served,
    Stats,
    StoreResult,
    UnregisterKVCache,
    ipc_namespace_id,
)
from kvdepot.rpc.auth import Caller
from kvdepot.rpc.router import ReplyFn
from kvdepot.server.block_event_log import BlockEventLog
from kvdepot.server.control_path import ControlPath
from kvdepot.server.data_path import DataPath
from kvdepot.server.drain import Drain
from kvdepot.server.engines import (  # noqa: F401  (the bounds, re-exported for callers)
    MAX_REGISTRATIONS,
    MAX_REGISTRATIONS_PER_CONNECTION,
    MAX_REGISTRATIONS_PER_TENANT,
    EngineRegistry,
)
from kvdepot.server.handover import HandoverListener
from kvdepot.server.kv_event_publisher import KVEventPublisher
from kvdepot.server.lookups import EXPIRE_BATCH, LookupTable
from kvdepot.server.tenants import TenantAdmin
from kvdepot.storage.cpu_tier import CPUTier
from kvdepot.storage.lower_tiers import LowerTiers
from kvdepot.storage.tier import LowerTier
from kvdepot.transfer.copy_process.client import CopyProcesses

log = logging.getLogger(__name__)
bad_input_log = LogLimiter(log)

_ADMIN_ONLY = frozenset({RequestType.CLEAR, RequestType.STATS})
_REFUSED_WHILE_DRAINING = frozenset({RequestType.STORE, RequestType.REGISTER_KV_CACHE})


class Depot:
    """Implements the transport's `Dispatcher` for every kvdepot request type."""

    def __init__(self, config: Options, tier: CPUTier, metrics: MetricsRegistry, *,
                 lower: LowerTiers, engines: EngineRegistry, lookups: LookupTable,
                 drain: Drain, data: DataPath, control: ControlPath, tenants: TenantAdmin,
                 handover: HandoverListener, events: KVEventPublisher | None,
                 block_events: BlockEventLog, copy_processes: CopyProcesses | None) -> None:
        """Takes its parts as `server/assembly.py` builds them (`assemble_depot`), which
        says what each is; the depot owns them from here on and closes them in order."""
        self.config = config
        self.events = events
        self.block_events = block_events
        self.on_drained: Callable[[], None] | None = None
        """Called once, on the control thread, when a drain is over (`begin_drain`)."""
        self.handover = handover
        self.boot_id = uuid.uuid4().hex
        self._ipc_namespace = ipc_namespace_id()
        self.tier = tier
        self.metrics = metrics
        self.lower = lower
        self.copy_processes = copy_processes
        self.engines = engines
        self.lookups = lookups
        self.drain = drain
        self.data = data
        self.control = control
        self.tenants = tenants
        self.transfer_threads = config.transfer_threads
        self._pool = ThreadPoolExecutor(self.transfer_threads, thread_name_prefix="kvdepot-xfer")
        self._next_expiry = 0.0
        self._reap_queued = False
        """A scan for dead engines is queued or running on a transfer thread."""
        self._handlers: dict[RequestType, Callable[[Any, Caller], Any]] = {
            RequestType.GET_CHUNK_SIZE: lambda _, __: self.config.chunk_size,
            RequestType.PING: lambda _, __: Pong(self.boot_id, self.handover.address,
                                                 os.getpid(), os.getuid(),
                                                 self.handover.path_name,
                                                 self._ipc_namespace),
            RequestType.LOOKUP: self.control.lookup,
            RequestType.QUERY_PREFETCH_STATUS: self.control.query,
            RequestType.FREE_LOOKUP_LOCKS: self.control.free_locks,
            RequestType.END_SESSION: self.control.end_session,
            RequestType.REPORT_BLOCK_ALLOCATION: self._report_allocations,
            RequestType.REGISTER_KV_CACHE: self._register,
            RequestType.UNREGISTER_KV_CACHE: self._unregister,
            RequestType.STORE: self.data.store,
            RequestType.RETRIEVE: self.data.retrieve,
            RequestType.CLEAR: self._clear,
            RequestType.STATS: lambda _, __: self.stats(),
            RequestType.TAKE_BLOCK_EVENTS: lambda request, caller: self.block_events.take(
                caller.identity.tenant, request.after),
        }
        # Where each handler runs is the protocol table's word (`REQUESTS[...].served`);
        # every kind but INLINE names the threads that run it.
        self._served = {t: kind.served for t, kind in REQUESTS.items()}
        self._threads = {Served.TRANSFER: self._pool}

    def lower_tier(self, name: str) -> LowerTier | None:
        """The lower tier called `name` ("disk", "shared"), if configured; its `status()`
        is what the admin API shows."""
        return next((tier for tier in self.lower.tiers if tier.name == name), None)

    # ---- Dispatcher -------------------------------------------------------------------
    def is_slow(self, request_type: RequestType) -> bool:
        return self._served.get(request_type, Served.INLINE) is not Served.INLINE

    def handle(self, request_type: RequestType, request: Message, caller: Caller) -> Any:
        if self._served.get(request_type) is not Served.INLINE:
            raise UnknownRequestType(f"{request_type.name} is not handled inline")
        if request_type in _ADMIN_ONLY and not caller.identity.is_admin:
            raise PermissionDenied(f"{request_type.name} needs an admin credential; "
                                   f"{caller.identity.name!r} has the role "
                                   f"{caller.identity.role!r}")
        if self.drain.active and request_type not in _ADMIN_ONLY:
            self.drain.heard()
        return self._handlers[request_type](request, caller)

    def submit(self, request_type: RequestType, request: Message, reply: ReplyFn,
               caller: Caller) -> None:
        handler = self._handlers[request_type]
        if self.draining:
            self.drain.heard()
        if self.draining and request_type in _REFUSED_WHILE_DRAINING:
            # Only what arrived before the drain began runs; retrieves still come for
            # lookups answered before it, and workers still unregister.
            if request_type is RequestType.STORE:
                self.metrics.add(stores_refused_draining=1)
                reply(StoreResult(stored=0, present=0, skipped_full=0))
            else:
                reply(InvalidRequest(f"the server is shutting down; {request_type.name} is "
                                     "refused while it drains"))
            return

        def run() -> None:
            try:
                outcome = handler(request, caller)
            except Exception as exc:  # every failure becomes an error reply
                if not isinstance(exc, KVDepotError):
                    log.exception("%s failed", request_type.name)
                outcome = exc
            try:
                reply(outcome)
            finally:
                # An error's traceback holds this frame, whose `outcome` holds the error: a
                # cycle only the garbage collector ends. It kept every failed request (a
                # message of up to 33 MiB) alive until a collection, which then freed them
                # all on the control loop (issue 27).
                del outcome
                self.drain.finished()

        self.drain.started()
        try:
            self._threads[self._served[request_type]].submit(run)
        except RuntimeError:  # the pool shut down: the server is stopping
            self.drain.finished()
            reply(InvalidRequest("the server is shutting down"))

    def start_threads(self, on_start: Callable[[], object]) -> None:
        _start_every_thread(self._pool, self.transfer_threads, on_start)

    def tick(self) -> None:
        if self.drain.is_over() and self.on_drained is not None:
            self.on_drained()
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + 1.0
            if not self._reap_queued:
                # One /proc read per registration: not on this (the control) thread.
                self._reap_queued = True
                self._pool.submit(self._reap_dead_engines)
            expired = self.lookups.expire(now)
            if expired:
                self.metrics.add(expired_lookups=expired)
                log.info("released the locks of %d lookups past their %.0f s TTL", expired,
                         self.lookups.lock_ttl)
            if expired == EXPIRE_BATCH:
                self._next_expiry = now  # more are due: go on at the next tick

    def _reap_dead_engines(self) -> None:
        """Release the memory of workers that died without unregistering (on a transfer
        thread)."""
        try:
            for engine in self.engines.dead():
                if self.engines.unregister(engine.instance_id):
                    self.metrics.add(reaped_engines=1)
                    log.warning("%s exited without unregistering; released its KV cache "
                                "mapping", engine)
        except Exception:
            log.exception("reaping dead engines failed")
        finally:
            self._reap_queued = False

    def close(self) -> None:
        self.control.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.lower.close()  # writes behind what is queued first
        self.lookups.clear()
        self.engines.close()
        if self.copy_processes is not None:
            self.copy_processes.close()
        self.handover.close()
        if self.events is not None:
            self.events.close()

    # ---- graceful drain -------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        """True from `begin_drain` on (the admin API's /readyz answers 503)."""
        return self.drain.active

    def begin_drain(self) -> None:
        """Stop taking new work before exiting (SIGTERM): lookups answer 0 (the engines
        compute), new stores store nothing, registrations are refused; stores and
        retrieves already submitted run to the end, and retrieves of lookups answered
        before keep being served, for at most `drain_timeout` seconds (server/drain.py).
        Then `on_drained` is called. Calling it again changes nothing."""
        self.drain.begin()

    # ---- the few requests of neither path ----------------------------------------------
    def _report_allocations(self, request: ReportBlockAllocation, _: Caller) -> None:
        self.metrics.add(block_allocation_reports=len(request.records))

    def _clear(self, _: Message, __: Caller) -> int:
        return self.tier.clear()

    def stats(self) -> Stats:
        return Stats(self.metrics.snapshot())

    # ---- registration -------------------------------------------------------------------
    def _register(self, request: RegisterKVCache, caller: Caller) -> Registered:
        files = self.handover.claim(request.handover_ticket, caller.identity.name,
                                    request.engine_pid)
        try:  # the ticket is used up either way: its descriptors are closed if refused
            self.engines.check_room(caller.connection, caller.identity.tenant)
            engine = self.engines.register(request, caller, files)
        finally:
            files.close()
        return Registered(instance_id=engine.instance_id, num_blocks=engine.layout.num_blocks,
                          chunk_bytes=engine.chunk_bytes)

    def _unregister(self, request: UnregisterKVCache, caller: Caller) -> None:
        self.engines.unregister(request.instance_id, caller.connection)


def _start_every_thread(pool: ThreadPoolExecutor, count: int,
                        on_start: Callable[[], object]) -> None:
    """Make `pool` start all `count` of its threads now, each running `on_start`. A pool
    starts a thread only when none of its threads is idle, so each task waits until every
    other one has arrived."""
    everyone = threading.Barrier(count)

    def arrive() -> None:
        on_start()
        everyone.wait(timeout=60)

    for started in [pool.submit(arrive) for _ in range(count)]:
        started.result()
