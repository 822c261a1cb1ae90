"""Bounds of the lookup table: locked bytes per tenant (a shared chunk counted once,
whatever connections hold it) and open jobs per connection and per tenant, with every way
of giving locks back."""

import torch

from kvdepot.server.lookups import LookupTable
from kvdepot.storage.cpu_tier import CPUTier

CHUNK_BYTES = 4096


def filled_tier(keys: list[bytes]) -> CPUTier:
    tier = CPUTier(torch.zeros(len(keys) * CHUNK_BYTES, dtype=torch.uint8))
    for key in keys:
        _, chunk = tier.reserve(key, CHUNK_BYTES, b"fp")
        tier.commit(chunk)
    return tier


def locked(tier: CPUTier, keys: list[list[bytes]], readers: int = 1) -> list[list[bytes]]:
    hit, _ = tier.lock_prefix(iter(keys), readers)
    return hit


KEYS = [bytes([i]) for i in range(8)]
CHUNKS = [[k] for k in KEYS]


def test_a_lookup_past_the_bound_locks_a_shorter_prefix():
    tier = filled_tier(KEYS)
    table = LookupTable(tier, 60.0, max_locked_bytes=3 * CHUNK_BYTES)
    job = table.start("a", locked(tier, CHUNKS, 5), 5, peer=b"p", tenant="t")
    assert job.hit_chunks == 3 and job.capped
    assert [tier.lock_count(k) for k in KEYS] == [5, 5, 5, 0, 0, 0, 0, 0]
    assert table.locked_bytes("t") == 3 * CHUNK_BYTES
    # Another connection of the same tenant shares its budget: chunks it holds already
    # cost nothing more, new ones do not fit.
    same = table.start("b", locked(tier, CHUNKS[:4]), 1, peer=b"q", tenant="t")
    assert same.hit_chunks == 3 and same.capped
    assert table.locked_bytes("t") == 3 * CHUNK_BYTES
    # Another tenant has its own.
    other = table.start("c", locked(tier, CHUNKS[3:5]), 1, peer=b"q", tenant="u")
    assert other.hit_chunks == 2 and not other.capped
    assert table.locked_bytes("u") == 2 * CHUNK_BYTES


def test_a_prefix_shared_by_many_jobs_counts_once():
    tier = filled_tier(KEYS)
    table = LookupTable(tier, 60.0, max_locked_bytes=4 * CHUNK_BYTES)
    for i in range(10):
        job = table.start(f"r{i}", locked(tier, CHUNKS[:4]), 1, peer=bytes([i]))
        assert job.hit_chunks == 4
    assert table.locked_bytes() == 4 * CHUNK_BYTES
    assert table.start("new", locked(tier, CHUNKS[4:6]), 1, peer=b"p").hit_chunks == 0


def test_every_release_gives_the_bytes_back():
    tier = filled_tier(KEYS)
    table = LookupTable(tier, 60.0, max_locked_bytes=8 * CHUNK_BYTES)
    table.start("free", locked(tier, CHUNKS[:2]), 1, peer=b"p")
    table.start("read", locked(tier, CHUNKS[2:4], 2), 2, peer=b"p")
    table.start("end", locked(tier, CHUNKS[4:6]), 1, peer=b"p")
    table.start("ttl", locked(tier, CHUNKS[6:8]), 1, peer=b"p")
    assert table.locked_bytes() == 8 * CHUNK_BYTES
    table.release_range("free", 0, 2 * 256, 256)
    table.release_reads("read", KEYS[2:4])
    assert table.locked_bytes() == 6 * CHUNK_BYTES  # "read" owes a second read
    table.release_reads("read", KEYS[2:4])
    table.end("end")
    assert table.locked_bytes() == 2 * CHUNK_BYTES
    assert table.expire(now=1e18) == 3  # "free", "read" (both emptied) and "ttl"
    assert table.locked_bytes() == 0 and len(table) == 0
    assert all(tier.lock_count(k) == 0 for k in KEYS)


def test_open_jobs_per_connection_are_bounded():
    tier = filled_tier(KEYS)
    table = LookupTable(tier, 60.0, max_jobs=3)
    for i in range(3):
        table.start(f"r{i}", [], 1, peer=b"p")
    assert not table.has_room(b"p", "r3")
    assert table.has_room(b"p", "r0")  # replacing its own job is always allowed
    assert table.has_room(b"q", "r3")
    table.end("r1")
    assert table.has_room(b"p", "r3")


def test_open_jobs_per_tenant_are_bounded_over_its_connections():
    tier = filled_tier(KEYS)
    table = LookupTable(tier, 60.0, max_jobs=3, max_tenant_jobs=4)
    for i in range(4):
        table.start(f"r{i}", [], 1, peer=bytes([i % 2]), tenant="t")
    assert not table.has_room(b"\5", "r4", "t")  # a fresh connection, the same tenant
    assert table.has_room(b"\5", "r4", "u")
    table.end("r0")
    assert table.has_room(b"\5", "r4", "t")


def test_a_request_id_cannot_name_another_tenants_session() -> None:
    from kvdepot.server.lookups import session_key

    assert session_key("", "acme\0req-1") != session_key("acme", "req-1")
    assert session_key("acme", "req-1") != session_key("acm", "e\0req-1")
