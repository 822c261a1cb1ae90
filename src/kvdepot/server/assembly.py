"""Where the server is put together: every part `kvdepot serve` runs is built here, from
its resolved options, and nowhere else.

`assemble_server` is what `serve` runs once the router and authentication are up: the
CPU pool (shared with each GPU's copy process where there are GPUs), the tiers and the
listeners they tell of every chunk, the KV event publisher, then the depot. Its last step,
`assemble_depot`, builds what the depot dispatches to (the lower tiers' write-behind, the
engine registry, the lookup table, the drain, the data and control paths, tenant
administration) and the gauges that read them; unit tests run that step alone, on a CPU
tier of their own. The depot itself only dispatches requests and runs the server's life.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from kvdepot.metrics import MetricsRegistry
from kvdepot.options import Options
from kvdepot.rpc.auth import ServerAuth
from kvdepot.server.block_event_log import BlockEventLog, TierListeners
from kvdepot.server.control_path import ControlPath
from kvdepot.server.data_path import DataPath
from kvdepot.server.depot import Depot
from kvdepot.server.drain import Drain
from kvdepot.server.engines import EngineRegistry
from kvdepot.server.handover import HandoverListener
from kvdepot.server.kv_event_publisher import KVEventPublisher, replay_url_for
from kvdepot.server.lookups import LookupTable
from kvdepot.server.socket_dir import SocketDir
from kvdepot.server.tenants import TenantAdmin
from kvdepot.sizes import format_size
from kvdepot.storage.cpu_tier import CPUTier
from kvdepot.storage.disk_tier import DiskTier
from kvdepot.storage.lower_tiers import LowerTiers
from kvdepot.storage.tenant_limits import TenantLimits
from kvdepot.storage.tier import LowerTier
from kvdepot.transfer.copy_process.client import CopyProcesses
from kvdepot.transfer.host_pool import allocate_pool, allocate_shared_pool

log = logging.getLogger("kvdepot.server")


class AssembledServer(NamedTuple):
    depot: Depot
    memory: str
    """What the CPU tier's memory is, for the line the server logs as it starts."""
    events: KVEventPublisher | None


def assemble_server(options: Options, metrics: MetricsRegistry, auth: ServerAuth,
                    shared: LowerTier | None, socket_dir: SocketDir | None = None
                    ) -> AssembledServer:
    """The pool, the tiers and the depot of a server with resolved `options`; `shared`:
    the shared tier (`shared_tier`), built before anything is bound so a bad URL is
    refused first; `socket_dir`: the directory engines of other namespaces reach the
    server through (--socket-dir), already claimed, where the handover socket is made.
    Each GPU's copy process starts last, so a server that fails to build leaves none
    behind."""
    assert options.l1_bytes is not None and options.transfer_threads is not None
    capacity = options.l1_bytes
    copy_processes: CopyProcesses | None = None
    if torch.cuda.is_available():
        pool, pool_fd = allocate_shared_pool(capacity)
        # More channels than transfer threads (which also register and unregister),
        # so no copy ever waits for a free one.
        copy_processes = CopyProcesses(pool_fd, capacity,
                                       pin=options.pin_memory is not False,
                                       channels=options.transfer_threads + 2)
        memory = "CPU memory (page-locked by each GPU's copy process)"
    else:
        pool = allocate_pool(capacity)
        memory = "CPU memory"
    limits = TenantLimits.from_pairs(options.tenant_quotas, options.tenant_reserves)
    limits.check(pool.numel(), "CPU memory")
    events = kv_event_publisher(options, auth, metrics)
    block_events = BlockEventLog(dropped=metrics.counter("block_events_dropped"))
    listeners = TierListeners(events, block_events)
    lower: list[LowerTier] = []
    if options.disk_path:
        disk_limits = TenantLimits.from_pairs(options.tenant_disk_quotas)
        disk_bytes = options.disk_bytes or 0
        disk_limits.check(disk_bytes, "disk")
        lower.append(DiskTier(options.disk_path, disk_bytes,
                              discarded=metrics.counter("lower_tier_discarded_chunks"),
                              limits=disk_limits, listener=listeners))
    if shared is not None:
        lower.append(shared)
    depot = assemble_depot(
        options,
        CPUTier(pool, evictions=metrics.counter("evictions"), limits=limits,
                listener=listeners),
        metrics,
        lower,
        HandoverListener(auth.store, socket_dir=socket_dir),
        events=events,
        block_events=block_events,
        copy_processes=copy_processes,
    )
    if copy_processes is not None:
        copy_processes.start(range(torch.cuda.device_count()))
    if events is not None:
        events.start()
        for tier in lower:
            if isinstance(tier, DiskTier):
                tier.announce()
    return AssembledServer(depot, memory, events)


def assemble_depot(config: Options, tier: CPUTier, metrics: MetricsRegistry,
                   lower_tiers: list[LowerTier] | None = None,
                   handover: HandoverListener | None = None,
                   events: KVEventPublisher | None = None,
                   block_events: BlockEventLog | None = None,
                   copy_processes: CopyProcesses | None = None) -> Depot:
    """The depot over `tier` and `lower_tiers`, with everything it dispatches to.

    `metrics` is the registry whose "evictions" counter `tier` was given; `handover`
    None: one that takes any credential (--insecure); `events`: the tiers' listener
    (already given to them), closed after the lower tiers are flushed; `block_events`:
    the tiers' other listener, which TAKE_BLOCK_EVENTS reads (None: a log of its own,
    which no tier tells anything); `copy_processes`: the GPUs' copy processes, which run
    every CUDA copy (None: no GPU, and CUDA registrations are refused), stopped last."""
    block_events = block_events or BlockEventLog(
        dropped=metrics.counter("block_events_dropped"))
    lower = LowerTiers(tier, lower_tiers or [],
                       written=metrics.counter("lower_tier_writes"),
                       promoted=metrics.counter("promoted_chunks"),
                       dropped_writes=metrics.counter("lower_tier_dropped_writes"),
                       skipped_slower={
                           lower.name: metrics.counter(f"{lower.name}_skipped_slower_chunks")
                           for lower in lower_tiers or []})
    if config.transfer_threads is None or config.max_registered_bytes is None \
            or config.tenant_max_registered_bytes is None:
        raise ValueError("the depot takes resolved options (Options.resolved)")
    engines = EngineRegistry(config.chunk_size, max_chunk_bytes=tier.capacity,
                             max_registered_bytes=config.max_registered_bytes,
                             tenant_max_registered_bytes=config.tenant_max_registered_bytes,
                             cuda_copies=copy_processes.map if copy_processes else None)
    lookups = LookupTable(tier, config.lock_ttl,
                          max_locked_bytes=int(config.max_locked_share * tier.capacity))
    # With no engine registered, no promised retrieve can come.
    drain = Drain(config.drain_timeout, lambda: lookups.pending_reads() if len(engines) else 0)
    _register_gauges(metrics, config, tier, lower, engines, lookups, drain, block_events)
    data = DataPath(tier, engines, lookups, config.chunk_size, metrics,
                    on_commit=lower.write_behind if lower else None,
                    block_events=block_events)
    control = ControlPath(config.chunk_size, tier, lookups, lower, drain, metrics,
                          config.promotion_threads, block_events)
    tenants = TenantAdmin(tier, lower, lookups, metrics)
    return Depot(config, tier, metrics, lower=lower, engines=engines, lookups=lookups,
                 drain=drain, data=data, control=control, tenants=tenants,
                 handover=handover or HandoverListener(None), events=events,
                 block_events=block_events, copy_processes=copy_processes)


def _register_gauges(metrics: MetricsRegistry, config: Options, tier: CPUTier,
                     lower: LowerTiers, engines: EngineRegistry, lookups: LookupTable,
                     drain: Drain, block_events: BlockEventLog) -> None:
    shared = next((lower_tier for lower_tier in lower.tiers if lower_tier.name == "shared"), None)
    gauges: dict[str, Callable[[], float]] = {
        "chunks": lambda: len(tier),
        "used_bytes": lambda: tier.used_bytes,
        "tail_bytes": lambda: tier.tail_bytes,
        "capacity_bytes": lambda: tier.capacity,
        "locked_chunks": tier.locked_chunks,
        "lookup_jobs": lambda: len(lookups),
        "registered_engines": lambda: len(engines),
        "chunk_size": lambda: config.chunk_size,
        "block_hash_bytes": lambda: block_events.hash_bytes,
        "transfers_in_flight": lambda: drain.in_flight,
        "draining": lambda: float(drain.active),
        "shared_available": lambda: float(shared is not None and shared.available),
        "shared_write_queue_chunks": lambda: (shared.queued_writes()
                                              if shared is not None else 0),
    }
    for name, read in gauges.items():
        metrics.gauge(name, read)


def shared_tier(options: Options, metrics: MetricsRegistry) -> LowerTier:
    """The Redis/Valkey tier of `--shared-tier`; it starts even if the server is unreachable
    (its breaker is then open and reconnects in the background)."""
    from kvdepot.storage.shared.address import parse_shared_tier_url, with_secrets
    from kvdepot.storage.shared.tier import SharedTier

    assert options.shared_tier_url is not None
    if (options.shared_tier_ttl < 1 or options.shared_tier_timeout <= 0
            or options.shared_tier_piece_bytes < 1):
        raise ValueError("--shared-tier-ttl must be at least 1 s, --shared-tier-timeout "
                         "positive and --shared-tier-piece-size positive")
    address = with_secrets(parse_shared_tier_url(options.shared_tier_url), options.shared_tier_user,
                           options.shared_tier_password_file)
    tier = SharedTier(address, ttl=options.shared_tier_ttl, timeout=options.shared_tier_timeout,
                      piece_bytes=options.shared_tier_piece_bytes,
                      ca_file=options.shared_tier_ca_file, metrics=metrics)
    log.info("shared tier %s: chunks kept %.0f s after their last use, in pieces of %s%s",
             address.display, options.shared_tier_ttl, format_size(options.shared_tier_piece_bytes),
             "" if tier.available else " (unreachable for now; reconnecting)")
    return tier


def kv_event_publisher(options: Options, auth: ServerAuth, metrics: MetricsRegistry
                       ) -> KVEventPublisher | None:
    """The KV event publisher of --kv-events, or None. Subscribers authenticate like
    clients (CURVE, admin credentials only), on loopback or beyond it."""
    if not options.kv_events:
        return None
    replay = options.kv_events_replay or replay_url_for(options.kv_events)
    return KVEventPublisher(options.kv_events, replay, options.chunk_size, auth,
                            published=metrics.counter("kv_events_published"),
                            dropped=metrics.counter("kv_events_dropped"))
