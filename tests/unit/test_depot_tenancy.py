"""The Depot methods the admin API builds on (quotas, use per tenant, scoped clear, drain),
and what a lookup answers while the server drains."""

from __future__ import annotations

import pytest

from kvdepot.protocol import KeyScope, Lookup, RequestType, pack_ints
from kvdepot.storage.chunk import ChunkScope
from tests.unit.support.depot import OWNER

CHUNK_BYTES = 64 << 10


def put(depot, tenant: str, name: str, model: str = "m", salt: str = "") -> None:
    _, chunk = depot.tier.reserve(f"{tenant}/{name}".encode(), CHUNK_BYTES, b"fp",
                                  ChunkScope(tenant, model, salt))
    depot.tier.commit(chunk)


def test_set_quota_evicts_down_to_it_and_quotas_lists_it(depot):
    for i in range(6):
        put(depot, "acme", str(i))
    put(depot, "other", "0")
    depot.tenants.set_quota("acme", 2 * CHUNK_BYTES)
    assert depot.tenants.quotas() == {"acme": 2 * CHUNK_BYTES}
    usage = depot.tenants.usage()
    assert usage["acme"]["chunks"] == 2 and usage["acme"]["cpu_bytes"] == 2 * CHUNK_BYTES
    assert usage["acme"]["quota_bytes"] == 2 * CHUNK_BYTES
    assert usage["other"]["chunks"] == 1 and "quota_bytes" not in usage["other"]
    assert depot.metrics.snapshot()["quota_evictions"] == 4
    depot.tenants.set_quota("acme", None)
    assert depot.tenants.quotas() == {}
    depot.tenants.set_quota("*", CHUNK_BYTES)  # the default: every named tenant over it shrinks
    assert depot.tenants.usage()["acme"]["chunks"] == 1
    assert depot.tenants.usage()["acme"]["quota_bytes"] == CHUNK_BYTES


@pytest.mark.parametrize("tenant, quota", [("", 1), ("bad name", 1), ("acme", -1),
                                           ("acme", 1.5), ("acme", True)])
def test_set_quota_refuses_what_cannot_be_a_quota(depot, tenant, quota):
    with pytest.raises(ValueError):
        depot.tenants.set_quota(tenant, quota)
    assert depot.tenants.quotas() == {}


def test_use_per_scope_and_a_clear_of_one_tenant(depot):
    put(depot, "acme", "0", salt="s1")
    put(depot, "acme", "1", salt="s2")
    put(depot, "acme", "2", salt="s2")
    put(depot, "", "0")
    scopes = sorted(depot.tenants.scope_usage(), key=lambda e: (e["tenant"], e["salt"]))
    assert scopes == [
        {"tenant": "", "model": "m", "salt": "", "chunks": 1, "cpu_bytes": CHUNK_BYTES},
        {"tenant": "acme", "model": "m", "salt": "s1", "chunks": 1, "cpu_bytes": CHUNK_BYTES},
        {"tenant": "acme", "model": "m", "salt": "s2", "chunks": 2,
         "cpu_bytes": 2 * CHUNK_BYTES},
    ]
    assert depot.tenants.clear("acme") == 3
    assert set(depot.tenants.usage()) == {""}


def test_while_draining_lookups_answer_zero_and_are_counted(depot):
    put(depot, "", "0")
    lookup = Lookup("r", KeyScope("m", 1), pack_ints(list(range(300))), 1)
    assert not depot.draining
    depot.begin_drain()
    depot.begin_drain()  # again: nothing changes
    assert depot.draining
    assert depot.handle(RequestType.LOOKUP, lookup, OWNER) == 0
    snapshot = depot.metrics.snapshot()
    assert snapshot["lookups_refused_draining"] == 1 and snapshot["draining"] == 1
    drained = []
    depot.on_drained = lambda: drained.append(True)
    depot.tick()  # nothing in flight, no promised read: over at once
    depot.tick()
    assert drained == [True]


def test_tenant_usage_counts_the_disk_tier_too(tmp_path):
    import torch

    from kvdepot.metrics import MetricsRegistry
    from kvdepot.options import DEFAULTS
    from kvdepot.server.assembly import assemble_depot
    from kvdepot.storage.cpu_tier import CPUTier
    from kvdepot.storage.disk_tier import DiskTier

    disk = DiskTier(tmp_path, 1 << 20)
    depot = assemble_depot(DEFAULTS.resolved(copy_processes=False),
                           CPUTier(torch.zeros(1 << 20, dtype=torch.uint8)),
                           MetricsRegistry(), [disk])
    try:
        disk.write_chunk(b"k", b"fp", memoryview(bytes(1000)), ChunkScope("acme"))
        usage = depot.tenants.usage()["acme"]
        assert usage["cpu_bytes"] == 0 and usage["disk_chunks"] == 1
        assert usage["disk_bytes"] > 1000
    finally:
        depot.close()
