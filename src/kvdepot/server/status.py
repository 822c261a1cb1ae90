"""What `GET /v1/status` reports: one dict built on the control thread.

The admin API runs this through `RouterServer.call_in_loop`, so everything it reads that
the control thread changes (lookup jobs, tenants' usage) is read from that thread; the
storage tiers and the engine registry hold their own locks. Nothing here walks every
chunk: the control thread's time is every engine's lookup latency.
"""

from __future__ import annotations

import time
from importlib import metadata
from typing import Any

from kvdepot.server.depot import Depot


def _version() -> str:
    try:
        return metadata.version("kvdepot")
    except metadata.PackageNotFoundError:
        return "unknown"


VERSION = _version()


def server_status(depot: Depot, started_at: float) -> dict[str, Any]:
    """`started_at`: `time.monotonic()` when the server started."""
    tier = depot.tier
    lookups = depot.lookups.summary()
    return {
        "version": VERSION,
        "boot_id": depot.boot_id,
        "url": depot.config.url,
        "uptime_seconds": round(time.monotonic() - started_at, 3),
        "chunk_size": depot.config.chunk_size,
        "draining": depot.draining,
        "tiers": [
            {"name": "cpu", "capacity_bytes": tier.capacity, "used_bytes": tier.used_bytes,
             "tail_bytes": tier.tail_bytes, "chunks": len(tier)},
            *({**lower.status(), **depot.lower.speeds[lower.name].status()}
              for lower in depot.lower.tiers),
        ],
        "engines": depot.engines.describe(),
        "sessions": {"lookup_jobs": lookups["lookup_jobs"],
                     "connections": lookups["connections"]},
        "locks": {"locked_keys": lookups["locked_keys"],
                  "locked_bytes": lookups["locked_bytes"]},
        "tenants": tenants(depot),
        "counters": depot.metrics.counters(),
    }


def tenants(depot: Depot) -> dict[str, dict[str, Any]]:
    """Use per tenant ("" is the owner's and tenant-less credentials' scope) with its
    quota (None: none), tenants with a quota and nothing stored included."""
    usage = depot.tenants.usage()
    quotas = depot.tenants.quotas()
    out: dict[str, dict[str, Any]] = {}
    for tenant in sorted(set(usage) | set(quotas)):
        entry = dict(usage.get(tenant) or {"cpu_bytes": 0, "chunks": 0})
        entry["quota_cpu_bytes"] = quotas.get(tenant)
        out[tenant] = entry
    return out
