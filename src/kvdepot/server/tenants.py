"""Tenant administration: quotas, what each tenant holds, and clearing by scope.

What the admin API and the status page ask of the tiers about tenants, in one place;
the bounds themselves live in `kvdepot.storage.tenant_limits`.
"""

from __future__ import annotations

import logging
from typing import Any

from kvdepot.metrics import MetricsRegistry
from kvdepot.rpc.credentials import check_name
from kvdepot.server.lookups import LookupTable
from kvdepot.storage.cpu_tier import CPUTier
from kvdepot.storage.disk_tier import DiskTier
from kvdepot.storage.lower_tiers import LowerTiers
from kvdepot.storage.tenant_limits import DEFAULT_TENANT

log = logging.getLogger(__name__)


class TenantAdmin:
    """Quotas and use per tenant, over the CPU tier, the disk tier and the lookups' locks."""

    def __init__(self, tier: CPUTier, lower: LowerTiers, lookups: LookupTable,
                 metrics: MetricsRegistry) -> None:
        self.tier = tier
        self.lower = lower
        self.lookups = lookups
        self.metrics = metrics

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

    def usage(self) -> dict[str, dict[str, int]]:
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

    def clear(self, tenant: str | None = None, model: str | None = None,
              cache_salt: str | None = None) -> int:
        """Drop every unlocked chunk in CPU memory, or only those of the scope given (`tenant`
        "" for credentials without a tenant; None: any); returns how many went."""
        return self.tier.clear(tenant, model, cache_salt)
