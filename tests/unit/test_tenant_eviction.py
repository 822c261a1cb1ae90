"""The CPU tier's quotas and fair eviction between tenants (issue 12, item 2), one chunk
size throughout so counts are easy to read."""

from __future__ import annotations

import torch

from kvdepot.storage.chunk import ChunkScope
from kvdepot.storage.cpu_tier import CPUTier, ReserveOutcome
from kvdepot.storage.tenant_limits import TenantLimits

CHUNK = 4096


def tier(chunks: int, quotas: dict[str, int] | None = None,
         reserves: dict[str, int] | None = None) -> CPUTier:
    limits = TenantLimits({t: n * CHUNK for t, n in (quotas or {}).items()},
                          {t: n * CHUNK for t, n in (reserves or {}).items()})
    return CPUTier(torch.zeros(chunks * CHUNK, dtype=torch.uint8), limits=limits)


def put(t: CPUTier, tenant: str, name: str) -> ReserveOutcome:
    outcome, chunk = t.reserve(f"{tenant}/{name}".encode(), CHUNK, b"fp", ChunkScope(tenant))
    if chunk is not None:
        t.commit(chunk)
    return outcome


def held(t: CPUTier, tenant: str, names: range) -> list[int]:
    return [i for i in names if t.contains(f"{tenant}/{i}".encode())]


def test_a_tenant_over_its_quota_evicts_its_own_oldest_chunks():
    t = tier(16, quotas={"a": 4})
    for i in range(3):
        put(t, "b", str(i))
    for i in range(10):
        assert put(t, "a", str(i)) is ReserveOutcome.RESERVED
    assert held(t, "a", range(10)) == [6, 7, 8, 9]
    assert held(t, "b", range(3)) == [0, 1, 2]  # memory had room: nobody else lost a chunk
    assert t.usage()["a"] == {"cpu_bytes": 4 * CHUNK, "chunks": 4}


def test_the_default_quota_applies_to_every_named_tenant_but_not_to_the_untenanted():
    t = tier(16, quotas={"*": 2, "big": 6})
    for tenant in ("x", "big", ""):
        for i in range(5):
            put(t, tenant, str(i))
    assert t.usage()["x"]["chunks"] == 2
    assert t.usage()["big"]["chunks"] == 5
    assert t.usage()[""]["chunks"] == 5


def test_a_burst_never_takes_another_tenant_below_its_reserve():
    t = tier(8, reserves={"a": 3})
    for i in range(5):
        put(t, "a", str(i))
    for i in range(20):  # b alone could use all of memory
        assert put(t, "b", str(i)) is ReserveOutcome.RESERVED
    assert held(t, "a", range(5)) == [2, 3, 4]  # a's newest three, its reserve
    assert len(held(t, "b", range(20))) == 5
    # a's own stores take the least recently used chunk among its own and b's (b has no
    # reserve): a/3 is older than every chunk of b's.
    t.lock_prefix(iter([[b"a/2"]]), 1)  # a/2 is now a's most recently used, and locked
    put(t, "a", "new")
    assert held(t, "a", range(5)) == [2, 4] and t.contains(b"a/new")
    assert len(held(t, "b", range(20))) == 5
    for i in range(3):  # once a's unlocked chunks are newer than b's, b's oldest go
        put(t, "a", f"more{i}")
    assert t.contains(b"a/2") and len(held(t, "b", range(20))) == 3


def test_without_limits_eviction_is_lru_across_tenants():
    t = tier(4)
    put(t, "a", "0")
    put(t, "b", "0")
    put(t, "a", "1")
    put(t, "b", "1")
    t.pin([b"a/0"])  # touched: the oldest is now b/0, then a/1
    put(t, "c", "0")
    put(t, "c", "1")
    assert t.contains(b"a/0") and t.contains(b"b/1")
    assert not t.contains(b"b/0") and not t.contains(b"a/1")


def test_a_quota_full_of_locked_chunks_skips_the_store_and_evicts_nobody_else():
    t = tier(8, quotas={"a": 2})
    put(t, "a", "0")
    put(t, "a", "1")
    put(t, "b", "0")
    t.lock_prefix(iter([[b"a/0"], [b"a/1"]]), 1)
    assert put(t, "a", "2") is ReserveOutcome.OVER_QUOTA
    assert t.contains(b"b/0") and len(t) == 3


def test_lowering_a_quota_evicts_the_tenant_down_to_it():
    t = tier(16)
    for i in range(6):
        put(t, "a", str(i))
    put(t, "b", "0")
    t.limits.set_quota("a", 2 * CHUNK)
    assert t.enforce_quota("a") == 4
    assert held(t, "a", range(6)) == [4, 5] and t.contains(b"b/0")


def test_a_tenant_over_a_lowered_quota_is_evicted_first_when_memory_is_full():
    t = tier(4)
    put(t, "b", "0")  # the oldest chunk
    for i in range(3):
        put(t, "a", str(i))
    t.limits.set_quota("a", 1 * CHUNK)  # not enforced yet: a holds 3 of its 1
    put(t, "c", "0")
    assert t.contains(b"b/0") and held(t, "a", range(3)) == [1, 2]


def test_clear_of_one_tenant_leaves_the_others():
    t = tier(8)
    for tenant in ("a", "b"):
        for i in range(3):
            put(t, tenant, str(i))
    assert t.clear("a") == 3
    assert len(held(t, "a", range(3))) == 0 and len(held(t, "b", range(3))) == 3
    assert "a" not in t.usage()


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, bytes]] = []

    def stored(self, tier: str, key: bytes, scope: ChunkScope, parent: bytes | None) -> None:
        self.events.append(("stored", tier, key))

    def removed(self, tier: str, chunks: list[tuple[bytes, str]]) -> None:
        self.events.extend(("removed", tier, key) for key, _ in chunks)


def test_the_listener_hears_every_chunk_in_and_out_in_order():
    recorder = Recorder()
    t = tier(2)
    t.listener = recorder
    put(t, "a", "0")
    put(t, "a", "1")
    put(t, "a", "2")
    _, writing = t.reserve(b"w", CHUNK, b"fp")
    t.abort(writing)  # never visible: never announced
    t.clear()
    assert recorder.events == [("stored", "cpu", b"a/0"), ("stored", "cpu", b"a/1"),
                               ("removed", "cpu", b"a/0"), ("stored", "cpu", b"a/2"),
                               ("removed", "cpu", b"a/1"), ("removed", "cpu", b"a/2")]


def test_lowering_a_quota_far_evicts_in_rounds_down_to_it():
    t = tier(700)
    for i in range(600):
        put(t, "a", str(i))
    t.limits.set_quota("a", 10 * CHUNK)
    assert t.enforce_quota("a") == 590
    assert held(t, "a", range(600)) == list(range(590, 600))
