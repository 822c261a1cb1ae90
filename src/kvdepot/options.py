"""Every setting of kvdepot and its default, in one place.

The command line, the server, the clients and the vLLM connector all read `Options`
(or `DEFAULTS`, its default instance); none of them writes a default of its own.
This module imports nothing heavy, so `kvdepot --help` stays fast.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from kvdepot.sizes import available_memory, host_memory


def default_transfer_threads(copy_processes: bool) -> int:
    """Four, or eight when GPUs' copy processes run the CUDA copies; the CPUs this
    process may use if fewer.

    CPU engines' copies are memcpy on these threads, and more threads than cores only
    contend. With copy processes a thread spends most of an operation waiting for its
    copy process, and with four the GPU ran dry between operations when both directions
    ran at once (docs/benchmarks.md).
    """
    return min(8 if copy_processes else 4, len(os.sched_getaffinity(0)))


def default_l1_bytes() -> int:
    """A quarter of the memory available now, at least 256 MiB."""
    return max(256 << 20, available_memory() // 4)


def default_disk_bytes(disk_path: str) -> int:
    """Half the free space of the file system `disk_path` is (or will be created) on."""
    where = Path(disk_path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free // 2


def default_registered_bytes() -> tuple[int, int]:
    """(in all, per named tenant) bytes of CPU KV memory registrations may map by default:
    the host's memory, and half of it. Every byte a CPU engine registers is its KV cache,
    already in host memory, so together they cannot legitimately exceed it; half keeps one
    tenant from taking every other tenant's room. Without /proc/meminfo: no bound."""
    total = host_memory() or (1 << 62)
    return total, total // 2


@dataclass(frozen=True)
class Options:
    # ---- where the server listens (clients connect to `url`) --------------------------
    host: str = "127.0.0.1"
    port: int = 5555

    # ---- the server -------------------------------------------------------------------
    chunk_size: int = 256
    """Tokens per cached chunk; engines' block sizes must divide it."""
    l1_bytes: int | None = None
    """CPU memory for the cache; None: `default_l1_bytes()` when the server starts."""
    lock_ttl: float = 300.0
    """Seconds after which an unused lookup lock expires."""
    transfer_threads: int | None = None
    """Threads running stores, retrieves and registrations; None:
    `default_transfer_threads(...)` when the server starts."""
    max_locked_share: float = 0.5
    """The share of CPU memory one tenant's lookups may hold read-locked (over all its
    connections; credentials without a tenant count as one): the rest stays evictable, so
    one client cannot make every other engine's stores skip."""
    promotion_threads: int = 2
    """Threads reading chunks up from lower tiers for lookups."""
    pin_memory: bool | None = None
    """Have each GPU's copy process page-lock the CPU pool; None: yes (False only for
    tests that cannot lock that much memory)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port; None: off."""
    metrics_host: str = "127.0.0.1"
    """Interface of the metrics port (the exposition has no authentication)."""
    admin_port: int | None = None
    """Serve the HTTP admin API and dashboard on this port (docs/admin.md); None: off."""
    admin_host: str = "127.0.0.1"
    """Interface of the admin port; beyond loopback it needs TLS and a credential for every
    endpoint (or --insecure)."""
    admin_tls_cert: str | None = None
    """PEM certificate chain of the admin API (HTTPS); None: plain HTTP."""
    admin_tls_key: str | None = None
    """PEM private key of `admin_tls_cert`."""
    state_dir: str | None = None
    """The server's credentials directory; None: $KVDEPOT_STATE_DIR, else ~/.kvdepot."""
    socket_dir: str | None = None
    """A directory for the request socket (ipc://DIR/kvdepot.sock) and the handover socket,
    which engines in other namespaces (containers) mount; None: none (server/socket_dir.py)."""
    insecure: bool = False
    """No authentication at all (needed to listen beyond loopback without CURVE)."""
    disk_path: str | None = None
    """Directory of the local-disk tier; None: no disk tier."""
    disk_bytes: int | None = None
    """Capacity of the disk tier; None: `default_disk_bytes(disk_path)` when the server
    starts (0 without a disk tier)."""
    max_registered_bytes: int | None = None
    """CPU KV memory all engines' registrations may map together; None:
    `default_registered_bytes()` when the server starts (CUDA registrations do not count:
    they cost the host nothing)."""
    tenant_max_registered_bytes: int | None = None
    """CPU KV memory the registrations of one named tenant may map; None: as above. The
    owner's scope (no tenant) has only the bound in all."""
    tenant_quotas: tuple[tuple[str, int], ...] = ()
    """(tenant, bytes) of CPU memory each tenant may hold; tenant "*": every named tenant
    without its own (storage/tenant_limits.py)."""
    tenant_reserves: tuple[tuple[str, int], ...] = ()
    """(tenant, bytes) of CPU memory no other tenant's store evicts; "*" as above."""
    tenant_disk_quotas: tuple[tuple[str, int], ...] = ()
    """(tenant, bytes) of the disk tier each tenant may hold; "*" as above."""
    kv_events: str | None = None
    """Publish KV events on this tcp://HOST:PORT (ZeroMQ PUB); None: off."""
    kv_events_replay: str | None = None
    """The KV events' replay socket; None: the events' port plus one."""
    drain_timeout: float = 20.0
    """Seconds a SIGTERM waits for stores and retrieves in flight before the server exits
    (writing behind to lower tiers is waited for after it)."""
    shared_tier_url: str | None = None
    """The shared tier: redis://, rediss://, redis+cluster:// or rediss+cluster:// (see
    `kvdepot.storage.shared.address`); None: no shared tier."""
    shared_tier_ttl: float = 86400.0
    """Seconds a chunk stays in the shared tier after it was last written or read."""
    shared_tier_user: str | None = None
    """ACL user for the shared tier (the URL may name it too)."""
    shared_tier_password_file: str | None = None
    """File whose first line is the shared tier's password; None: $KVDEPOT_SHARED_TIER_PASSWORD."""
    shared_tier_ca_file: str | None = None
    """CA bundle that signed the shared tier's TLS certificates; None: the system's."""
    shared_tier_timeout: float = 1.0
    """Seconds one round trip to the shared tier may take before its breaker opens."""
    shared_tier_piece_bytes: int = 4 << 20
    """Bytes per piece of a chunk in the shared tier (docs/shared-tier.md measures it)."""

    # ---- the clients ------------------------------------------------------------------
    mq_timeout: float = 300.0
    """Seconds a blocking request (chunk size, registration, store, retrieve) may take."""
    unregister_timeout: float = 5.0
    """Seconds a worker's shutdown waits for its unregister (at most mq_timeout): the
    engine is going away, and a server that does not answer reaps it anyway."""
    lookup_timeout: float = 5.0
    """Seconds the scheduler waits for a lookup before treating it as a miss."""
    connect_timeout: float = 5.0
    """Seconds a client waits for the server to accept its connection."""
    heartbeat_interval: float = 10.0
    """Seconds between health pings while the server is healthy."""
    credentials: str | None = None
    """A credential file to present; None: $KVDEPOT_CREDENTIALS, else the owner credential
    a server of this user wrote for the URL (docs/security.md)."""

    # ---- the vLLM connector (kv_connector_extra_config "kvdepot.<name>") ----------------
    store_generated: bool = False
    """Also store full chunks of generated tokens, not only the prompt's."""
    recompute_on_load_failure: bool = True
    """Set vLLM's `kv_load_failure_policy` to `recompute`; False keeps vLLM's policy."""
    report_block_allocations: bool = False
    """Send the scheduler's per-step block allocations to the server (telemetry)."""
    preemption_wait_s: float = 30.0
    """Seconds a worker waits for the stores of a preempted request before vLLM reuses its
    blocks."""
    tails: bool = True
    """Also store and load a prompt's tail, its tokens past its last whole chunk, so a hit
    of a prompt seen before leaves the engine one token to compute. Only for models with
    one KV cache group (no sliding-window layers); False keeps whole chunks only."""
    skip_slow_loads: bool = True
    """Load only what arrives sooner than the engine computes it: the engine's measured
    prefill rate goes with each lookup, so the server reads from its disk and shared tiers
    only what loads faster, and where vLLM holds a prefix the connector computes the rest
    itself unless a load (timed from the engine's own loads) would bring it sooner. False
    loads every chunk held (an engine short of compute may prefer that)."""
    inline_loads: bool = True
    """When nothing else runs on the engine, load a hit inside the step that computes the
    request (vLLM's synchronous load) instead of beside the steps (its asynchronous load):
    the request skips the engine steps that carry a finished load back to the scheduler.
    Never while other requests run, whose step would wait for the copy. One KV cache group
    only. False: every load is asynchronous."""
    staging_mib: int = 1024
    """Where vLLM schedules asynchronously (its default on GPUs) and the scheduler shares
    the worker's process (one GPU, vLLM's single-process executor): MiB of the worker's
    device memory, beside vLLM's KV cache, into which a hit on an idle engine is copied
    before vLLM is told of it, so it loads synchronously and cannot fail (the worker then
    moves it into the request's blocks within device memory). A hit larger than the area
    loads asynchronously. 0: none, every such load is asynchronous."""
    debug_retrieve_delay_s: float = 0.0
    """Test hook only: the worker sleeps this long before each batch of retrieves."""

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def resolved(self, copy_processes: bool) -> Options:
        """These options with every computed default filled in: called once, when the
        server starts (`copy_processes`: GPUs' copy processes will run the CUDA copies)."""
        total, per_tenant = default_registered_bytes()
        disk_bytes = self.disk_bytes
        if disk_bytes is None:
            disk_bytes = default_disk_bytes(self.disk_path) if self.disk_path else 0
        return replace(
            self,
            l1_bytes=self.l1_bytes or default_l1_bytes(),
            transfer_threads=self.transfer_threads or default_transfer_threads(copy_processes),
            disk_bytes=disk_bytes,
            max_registered_bytes=(total if self.max_registered_bytes is None
                                  else self.max_registered_bytes),
            tenant_max_registered_bytes=(per_tenant if self.tenant_max_registered_bytes is None
                                         else self.tenant_max_registered_bytes),
        )


DEFAULTS = Options()
