"""How much of a tier each tenant may hold (its quota) and how much of it other tenants'
stores can never take away (its reserve).

Tenants are the names credentials carry (`rpc.auth.Identity.tenant`). Chunks stored
through credentials without a tenant belong to the untenanted space "" (the owner's
engines): it has no quota and no reserve, whatever the defaults say. The default (`*`
on the command line) applies to every named tenant that has no value of its own.

Thread-safe for the tiers' use: a tier reads the limits under its own mutex, and a
change (the admin API's `TenantAdmin.set_quota`) replaces one dict entry at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_TENANT = "*"
"""The name that stands for every named tenant without a value of its own."""


@dataclass
class TenantLimits:
    quotas: dict[str, int] = field(default_factory=dict)
    """Bytes a tenant may hold; its own least recently used chunks make room past it."""
    reserves: dict[str, int] = field(default_factory=dict)
    """Bytes of a tenant that another tenant's store never evicts."""

    @classmethod
    def from_pairs(cls, quotas: tuple[tuple[str, int], ...] = (),
                   reserves: tuple[tuple[str, int], ...] = ()) -> TenantLimits:
        return cls(dict(quotas), dict(reserves))

    def quota(self, tenant: str) -> int | None:
        if not tenant:
            return None
        return self.quotas.get(tenant, self.quotas.get(DEFAULT_TENANT))

    def reserve(self, tenant: str) -> int:
        """A tenant's guaranteed share: its reserve, never more than its quota."""
        if not tenant:
            return 0
        reserve = self.reserves.get(tenant, self.reserves.get(DEFAULT_TENANT, 0))
        quota = self.quota(tenant)
        return reserve if quota is None else min(reserve, quota)

    def set_quota(self, tenant: str, nbytes: int | None) -> None:
        if nbytes is None:
            self.quotas.pop(tenant, None)
        else:
            self.quotas[tenant] = nbytes

    def check(self, capacity: int, what: str) -> None:
        """Refuse limits that cannot all hold: reserves named explicitly that add up to
        more than the tier, or any value below zero."""
        for name, table in (("quota", self.quotas), ("reserve", self.reserves)):
            for tenant, nbytes in table.items():
                if nbytes < 0:
                    raise ValueError(f"the {what} {name} of tenant {tenant!r} is negative")
        named = sum(v for t, v in self.reserves.items() if t != DEFAULT_TENANT)
        if named > capacity:
            raise ValueError(f"the {what} reserves add up to {named} bytes, more than the "
                             f"{capacity} bytes of the tier")

