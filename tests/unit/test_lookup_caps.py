"""Per-connection bounds of the lookup table: locked bytes (a shared chunk counted once)
and open jobs, with every way of giving locks back."""

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
    job = table.start("a", locked(tier, CHUNKS, 5), 5, peer=b"p")
    assert job.hit_chunks == 3 and job.capped
    assert [tier.lock_count(k) for k in KEYS] == [5, 5, 5, 0, 0, 0, 0, 0]
    assert table.locked_bytes(b"p") == 3 * CHUNK_BYTES
    # Another connection has its own budget.
    other = table.start("b", locked(tier, CHUNKS[:2]), 1, peer=b"q")
    assert other.hit_chunks == 2 and not other.capped


def test_a_prefix_shared_by_many_jobs_counts_once():
    tier = filled_tier(KEYS)
    table = LookupTable(tier, 60.0, max_locked_bytes=4 * CHUNK_BYTES)
    for i in range(10):
        job = table.start(f"r{i}", locked(tier, CHUNKS[:4]), 1, peer=b"p")
        assert job.hit_chunks == 4
    assert table.locked_bytes(b"p") == 4 * CHUNK_BYTES
    assert table.start("new", locked(tier, CHUNKS[4:6]), 1, peer=b"p").hit_chunks == 0


def test_every_release_gives_the_bytes_back():
    tier = filled_tier(KEYS)
    table = LookupTable(tier, 60.0, max_locked_bytes=8 * CHUNK_BYTES)
    table.start("free", locked(tier, CHUNKS[:2]), 1, peer=b"p")
    table.start("read", locked(tier, CHUNKS[2:4], 2), 2, peer=b"p")
    table.start("end", locked(tier, CHUNKS[4:6]), 1, peer=b"p")
    table.start("ttl", locked(tier, CHUNKS[6:8]), 1, peer=b"p")
    assert table.locked_bytes(b"p") == 8 * CHUNK_BYTES
    table.release_chunks("free", 0, 2)
    table.release_reads("read", KEYS[2:4])
    assert table.locked_bytes(b"p") == 6 * CHUNK_BYTES  # "read" owes a second read
    table.release_reads("read", KEYS[2:4])
    table.end("end")
    assert table.locked_bytes(b"p") == 2 * CHUNK_BYTES
    assert table.expire(now=1e18) == 3  # "free", "read" (both emptied) and "ttl"
    assert table.locked_bytes(b"p") == 0 and len(table) == 0
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


def test_a_request_id_cannot_name_another_tenants_session() -> None:
    from kvdepot.server.lookups import session_key

    assert session_key("", "acme\0req-1") != session_key("acme", "req-1")
    assert session_key("acme", "req-1") != session_key("acm", "e\0req-1")
