"""The request handlers: one method per request type, wired to storage and the data path."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvdepot.errors import InvalidRequest, KVDepotError, PermissionDenied, UnknownRequestType
from kvdepot.keys import HASH_BYTES, iter_prefix_keys, scope_root
from kvdepot.log_limiter import LogLimiter
from kvdepot.metrics import MetricsRegistry
from kvdepot.options import Options, default_transfer_threads
from kvdepot.protocol import (
    REQUESTS,
    EndSession,
    FreeLookupLocks,
    Lookup,
    Message,
    Pong,
    QueryPrefetchStatus,
    Registered,
    RegisterKVCache,
    ReportBlockAllocation,
    RequestType,
    Served,
    Stats,
    StoreResult,
    UnregisterKVCache,
    unpack_ints,
)
from kvdepot.rpc.auth import Caller
from kvdepot.rpc.credentials import check_name
from kvdepot.rpc.router import ReplyFn
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
from kvdepot.server.lookups import EXPIRE_BATCH, LookupJob, LookupTable, session_key
from kvdepot.storage.chunk import ChunkScope
from kvdepot.storage.cpu_tier import CPUTier
from kvdepot.storage.disk_tier import DiskTier
from kvdepot.storage.lower_tiers import LowerTiers
from kvdepot.storage.tenant_limits import DEFAULT_TENANT
from kvdepot.storage.tier import LowerTier
from kvdepot.transfer.copy_process.client import CopyProcesses

log = logging.getLogger(__name__)
bad_input_log = LogLimiter(log)

_ADMIN_ONLY = frozenset({RequestType.CLEAR, RequestType.STATS})
_REFUSED_WHILE_DRAINING = frozenset({RequestType.STORE, RequestType.REGISTER_KV_CACHE})

class Depot:
    """Implements the transport's `Dispatcher` for every kvdepot request type."""

    def __init__(self, config: Options, tier: CPUTier, metrics: MetricsRegistry,
                 lower_tiers: list[LowerTier] | None = None,
                 handover: HandoverListener | None = None,
                 events: KVEventPublisher | None = None,
                 copy_processes: CopyProcesses | None = None) -> None:
        """`metrics` is the registry whose "evictions" counter `tier` was given; `handover`
        None: one that takes any credential (--insecure); `events`: the tiers' listener
        (already given to them), closed after the lower tiers are flushed;
        `copy_processes`: the GPUs' copy processes, which run every CUDA copy (None: no
        GPU, and CUDA registrations are refused), stopped last."""
        self.config = config
        self.events = events
        self.on_drained: Callable[[], None] | None = None
        """Called once, on the control thread, when a drain is over (`begin_drain`)."""
        self.handover = handover or HandoverListener(None)
        self.boot_id = uuid.uuid4().hex
        self.tier = tier
        self.metrics = metrics
        self.lower = LowerTiers(tier, lower_tiers or [],
                                written=metrics.counter("lower_tier_writes"),
                                promoted=metrics.counter("promoted_chunks"),
                                dropped_writes=metrics.counter("lower_tier_dropped_writes"))
        self._remote = self.lower_tier("remote")
        self.copy_processes = copy_processes
        self.engines = EngineRegistry(config.chunk_size, max_chunk_bytes=tier.capacity,
                                      cuda_copies=copy_processes.map if copy_processes else None,
                                      max_registered_bytes=config.max_registered_bytes,
                                      tenant_max_registered_bytes=(
                                          config.tenant_max_registered_bytes))
        self.lookups = LookupTable(tier, config.lock_ttl,
                                   max_locked_bytes=int(config.max_locked_share * tier.capacity))
        self.drain = Drain(config.drain_timeout, self.lookups.pending_reads)
        gauges: dict[str, Callable[[], float]] = {
            "chunks": lambda: len(tier),
            "used_bytes": lambda: tier.used_bytes,
            "capacity_bytes": lambda: tier.capacity,
            "locked_chunks": tier.locked_chunks,
            "lookup_jobs": lambda: len(self.lookups),
            "registered_engines": lambda: len(self.engines),
            "chunk_size": lambda: config.chunk_size,
            "transfers_in_flight": lambda: self.drain.in_flight,
            "draining": lambda: float(self.draining),
            "remote_available": lambda: float(self._remote is not None
                                              and self._remote.available),
            "remote_write_queue_chunks": lambda: (self._remote.queued_writes()
                                                  if self._remote is not None else 0),
        }
        for name, read in gauges.items():
            metrics.gauge(name, read)
        self.data = DataPath(tier, self.engines, self.lookups, config.chunk_size, metrics,
                             on_commit=self.lower.write_behind if self.lower else None)
        self.transfer_threads = (config.transfer_threads
                                 or default_transfer_threads(copy_processes is not None))
        self._pool = ThreadPoolExecutor(self.transfer_threads, thread_name_prefix="kvdepot-xfer")
        # Promotions wait on disk or network; they get threads of their own so they never
        # hold up a store or retrieve.
        self._promotions = ThreadPoolExecutor(config.promotion_threads,
                                              thread_name_prefix="kvdepot-promote")
        self._next_expiry = 0.0
        self._reap_queued = False
        """A scan for dead engines is queued or running on a transfer thread."""
        self._handlers: dict[RequestType, Callable[[Any, Caller], Any]] = {
            RequestType.GET_CHUNK_SIZE: lambda _, __: self.config.chunk_size,
            RequestType.PING: lambda _, __: Pong(self.boot_id, self.handover.address,
                                                 os.getpid(), os.getuid()),
            RequestType.LOOKUP: self._lookup,
            RequestType.QUERY_PREFETCH_STATUS: self._query,
            RequestType.FREE_LOOKUP_LOCKS: self._free_locks,
            RequestType.END_SESSION: self._end_session,
            RequestType.REPORT_BLOCK_ALLOCATION: self._report_allocations,
            RequestType.REGISTER_KV_CACHE: self._register,
            RequestType.UNREGISTER_KV_CACHE: self._unregister,
            RequestType.STORE: self.data.store,
            RequestType.RETRIEVE: self.data.retrieve,
            RequestType.CLEAR: self._clear,
            RequestType.STATS: lambda _, __: self.stats(),
        }
        # Where each handler runs is the protocol table's word (`REQUESTS[...].served`);
        # every kind but INLINE names the threads that run it.
        self._served = {t: kind.served for t, kind in REQUESTS.items()}
        self._threads = {Served.TRANSFER: self._pool}

    def lower_tier(self, name: str) -> LowerTier | None:
        """The lower tier called `name` ("disk", "remote"), if configured; its `status()`
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
        return self._handlers[request_type](request, caller)

    def submit(self, request_type: RequestType, request: Message, reply: ReplyFn,
               caller: Caller) -> None:
        handler = self._handlers[request_type]
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
        self._promotions.shutdown(wait=True, cancel_futures=True)
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

    # ---- tenants: quotas and use ------------------------------------------------------------
    def set_quota(self, tenant: str, cpu_bytes: int | None) -> None:
        """Cap the CPU memory `tenant` holds (None: no cap of its own; "*": the default of
        every named tenant without one). A lowered quota evicts the tenant's least
        recently used unlocked chunks at once. Lasts until the server stops."""
        if tenant != DEFAULT_TENANT:
            check_name("tenant", tenant)
        if cpu_bytes is not None and (isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, int)
                                      or cpu_bytes < 0):
            raise ValueError(f"a quota is a number of bytes >= 0, got {cpu_bytes!r}")
        self.tier.limits.set_quota(tenant, cpu_bytes)
        log.info("quota of tenant %s: %s", tenant,
                 "none" if cpu_bytes is None else f"{cpu_bytes} bytes")
        evicted = 0
        for name in self.tier.usage() if tenant == DEFAULT_TENANT else [tenant]:
            evicted += self.tier.enforce_quota(name)
        if evicted:
            self.metrics.add(quota_evictions=evicted)

    def quotas(self) -> dict[str, int]:
        """The CPU memory quotas set, by tenant ("*": the default)."""
        return dict(self.tier.limits.quotas)

    def tenant_usage(self) -> dict[str, dict[str, int]]:
        """Per tenant holding chunks ("" for credentials without a tenant): "cpu_bytes"
        (chunks being stored included), "chunks", "reserve_bytes", "quota_bytes" when it
        has a quota, "locked_bytes" (held by its lookups), and "disk_bytes",
        "disk_chunks" with a disk tier."""
        limits = self.tier.limits
        usage = self.tier.usage()
        for tier in self.lower.tiers:
            if not isinstance(tier, DiskTier):
                continue  # the one lower tier that accounts per tenant
            for tenant, (chunks, nbytes) in tier.usage().items():
                entry = usage.setdefault(tenant, {"cpu_bytes": 0, "chunks": 0})
                entry["disk_bytes"] = nbytes
                entry["disk_chunks"] = chunks
        for tenant, entry in usage.items():
            entry["reserve_bytes"] = limits.reserve(tenant)
            entry["locked_bytes"] = self.lookups.locked_bytes(tenant)
            quota = limits.quota(tenant)
            if quota is not None:
                entry["quota_bytes"] = quota
        return usage

    def scope_usage(self) -> list[dict[str, Any]]:
        """Per (tenant, model, cache_salt) in CPU memory: "tenant", "model", "salt",
        "chunks", "cpu_bytes"."""
        return [{"tenant": scope.tenant, "model": scope.model, "salt": scope.salt,
                 "chunks": chunks, "cpu_bytes": nbytes}
                for scope, (chunks, nbytes) in self.tier.usage_by_scope().items()]

    # ---- control plane ------------------------------------------------------------------
    def _lookup(self, request: Lookup, caller: Caller) -> int | None:
        """Locks the hit and returns its chunk count (None would mean: ask again later)."""
        peer = caller.connection
        tenant = caller.identity.tenant
        session = session_key(tenant, request.request_id)
        if self.draining:
            self.metrics.add(lookups=1, lookups_refused_draining=1)
            return 0
        if not self.lookups.has_room(peer, session, tenant):
            self.metrics.add(lookups=1, lookups_refused=1)
            bad_input_log.warning("lookup-jobs", "a connection (or its tenant) has the most "
                                  "lookup jobs open (%d, %d); further lookups answer 0 until "
                                  "some end", self.lookups.max_jobs,
                                  self.lookups.max_tenant_jobs)
            return 0
        cs = self.config.chunk_size
        tokens = unpack_ints(request.token_ids)
        # Every whole chunk: the engine decides how much of the hit it loads (it computes
        # at least the prompt's last token itself, and may load the last chunk partly).
        wanted = len(tokens) // cs
        # Lazy: hashing stops soon after the first chunk missing from CPU memory.
        # The tenant comes from the credential, never from the request.
        wanted_keys = iter_prefix_keys(scope_root(request.scope, tenant), tokens,
                                       cs, wanted, request.scope.world_size)
        readers = request.readers_per_key
        hit, first_missing = self.tier.lock_prefix(wanted_keys, readers)
        # With every lower tier unreachable (breakers open) the lookup is answered now,
        # from CPU memory alone, rather than through a promotion that would find nothing.
        if first_missing is not None and self.lower.reachable():
            job = self.lookups.start(session, hit, readers, complete=False, peer=peer,
                                     tenant=tenant)
            self._count_capped(job)
            self.metrics.add(lookups=1, lookup_requested_tokens=len(tokens))
            if not job.capped:
                # The rest of the chain is hashed on the promotion thread, as far as it gets.
                scope = ChunkScope(tenant, request.scope.model, request.scope.cache_salt)
                parent = hit[-1][0][:HASH_BYTES] if hit else None
                self._promotions.submit(self._promote, job,
                                        itertools.chain([first_missing], wanted_keys), readers,
                                        scope, parent)
                return None
            self.lookups.finish(job)
        else:
            job = self.lookups.start(session, hit, readers, peer=peer, tenant=tenant)
            self._count_capped(job)
            self.metrics.add(lookups=1, lookup_requested_tokens=len(tokens))
        run = job.hit_chunks or 0
        self.metrics.add(hit_chunks=run, hit_tokens=run * cs)
        job.answered = True
        return job.hit_chunks

    def _count_capped(self, job: LookupJob) -> None:
        if job.capped:
            self.metrics.add(lookups_lock_capped=1)
            bad_input_log.warning("locked-share", "a tenant's lookups hold %d bytes locked, "
                                  "the most one tenant may; a lookup locked a shorter prefix",
                                  self.lookups.locked_bytes(job.tenant))

    def _promote(self, job: LookupJob, candidates: Iterable[list[bytes]], readers: int,
                 scope: ChunkScope, parent: bytes | None) -> None:
        """Extend a lookup's hit with chunks read up from lower tiers, in prefix order."""
        try:
            chunks = list(candidates)
            run = self.lower.bring_up_run(chunks, readers, scope, parent)
            for index, keys in enumerate(chunks[:run]):
                if not self.lookups.extend(job, keys, readers):
                    self._count_capped(job)
                    for later in chunks[index + 1:run]:
                        self.tier.unlock(dict.fromkeys(later, readers))
                    break
        except Exception:
            log.exception("reading lower tiers for lookup %s failed", job.request_id)
        finally:
            self.lookups.finish(job)
            hits = job.hit_chunks or 0
            self.metrics.add(hit_chunks=hits, hit_tokens=hits * self.config.chunk_size)

    def _query(self, request: QueryPrefetchStatus, caller: Caller) -> int | None:
        return self.lookups.query(session_key(caller.identity.tenant, request.request_id))

    def _free_locks(self, request: FreeLookupLocks, caller: Caller) -> None:
        cs = self.config.chunk_size
        if request.start < 0 or request.end < request.start:
            raise InvalidRequest(f"bad range [{request.start}, {request.end})")
        self.lookups.release_chunks(session_key(caller.identity.tenant, request.request_id),
                                    request.start // cs, request.end // cs)

    def _end_session(self, request: EndSession, caller: Caller) -> None:
        self.lookups.end(session_key(caller.identity.tenant, request.request_id))

    def _report_allocations(self, request: ReportBlockAllocation, _: Caller) -> None:
        self.metrics.add(block_allocation_reports=len(request.records))

    def _clear(self, _: Message, __: Caller) -> int:
        return self.tier.clear()

    def clear(self, tenant: str | None = None, model: str | None = None,
              cache_salt: str | None = None) -> int:
        """Drop every unlocked chunk in CPU memory, or only those of the scope given (`tenant`
        "" for credentials without a tenant; None: any); returns how many went."""
        return self.tier.clear(tenant, model, cache_salt)

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
