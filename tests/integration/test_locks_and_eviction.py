"""Lookup locks (TP, MLA readers, TTL, freeing) and eviction under memory pressure."""

import time

from tests.support.server import running_server, stats

CHUNK = 64
TOKENS = list(range(5000, 5000 + 6 * CHUNK + 1))


def test_tp2_chunk_counts_only_when_both_ranks_stored(engines):
    rank0 = engines(world_size=2, rank=0)
    rank1 = engines(world_size=2, rank=1)
    rank0.fill(seed=1)
    rank1.fill(seed=2)
    rank0.store("w", TOKENS, list(range(12)), 0, 3 * CHUNK)
    assert rank0.lookup("r1", TOKENS) == 0  # rank 1 holds nothing yet
    rank1.store("w", TOKENS, list(range(8)), 0, 2 * CHUNK)
    assert rank0.lookup("r2", TOKENS) == 2 * CHUNK
    # Each rank loads its own shard.
    assert rank1.retrieve("r2", TOKENS, list(range(20, 28)), 0, 2 * CHUNK) == set()
    assert rank0.retrieve("r2", TOKENS, list(range(20, 28)), 0, 2 * CHUNK) == set()
    import torch
    for a, b in zip(rank1.read_blocks(list(range(8))), rank1.read_blocks(list(range(20, 28))),
                    strict=True):
        assert torch.equal(a, b)
    # A TP=1 engine of the same model has other keys: world size scopes them.
    assert engines(world_size=1).lookup("r3", TOKENS) == 0


def test_mla_lock_allows_one_read_per_tp_rank(engines, server):
    writer = engines(layout="mla", use_mla=True, tp_size=2)
    writer.fill(seed=3)
    writer.store("w", TOKENS, list(range(8)), 0, 2 * CHUNK)
    assert writer.lookup("req", TOKENS) == 2 * CHUNK
    assert stats(server.url)["locked_chunks"] == 2
    reader_a = engines(layout="mla", use_mla=True, tp_size=2)
    assert reader_a.retrieve("req", TOKENS, list(range(8, 16)), 0, 2 * CHUNK) == set()
    assert stats(server.url)["locked_chunks"] == 2  # the second TP rank has yet to read
    assert writer.retrieve("req", TOKENS, list(range(8, 16)), 0, 2 * CHUNK) == set()
    assert stats(server.url)["locked_chunks"] == 0


def test_free_lookup_locks_and_end_session_release(engines, server):
    engine = engines()
    engine.store("w", TOKENS, list(range(16)), 0, 4 * CHUNK)
    assert engine.lookup("req", TOKENS) == 4 * CHUNK
    assert stats(server.url)["locked_chunks"] == 4
    # The engine's own prefix cache already holds 2.5 chunks: those two full chunks go.
    engine.call("scheduler", "free_lookup_locks", TOKENS, 0, 2 * CHUNK + 32, "req")
    deadline = time.monotonic() + 10
    while stats(server.url)["locked_chunks"] != 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stats(server.url)["locked_chunks"] == 2
    engine.call("scheduler", "end_session", "req")
    # The seed's public API, kept by the adapters: 64-token chunks of 16-token blocks.
    assert engine.call("scheduler", "num_blocks_per_chunk") == 4
    assert engine.call("worker", "num_blocks_per_chunk") == 4
    while stats(server.url)["locked_chunks"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stats(server.url)["locked_chunks"] == 0
    assert stats(server.url)["lookup_jobs"] == 0


def test_locks_expire_after_the_ttl(engines_at):
    with running_server(chunk_size=CHUNK, lock_ttl=1.0) as server:
        engine = engines_at(server.url)
        engine.store("w", TOKENS, list(range(8)), 0, 2 * CHUNK)
        assert engine.lookup("req", TOKENS) == 2 * CHUNK
        assert stats(server.url)["locked_chunks"] == 2
        deadline = time.monotonic() + 15
        while stats(server.url)["locked_chunks"] and time.monotonic() < deadline:
            time.sleep(0.1)
        final = stats(server.url)
        assert final["locked_chunks"] == 0 and final["expired_lookups"] == 1


def test_eviction_keeps_locked_chunks_and_reports_full(engines_at):
    # vllm_cpu layout, 2 layers, 2 heads x 64 dims, bf16: 64 tokens = 32 KiB per chunk.
    # 160 KiB of memory holds 5 chunks.
    # One connection may lock all of it here (by default only half: test_bounds.py).
    with running_server(chunk_size=CHUNK, l1_size="160KiB",
                        extra=("--max-locked-share", "1")) as server:
        engine = engines_at(server.url, num_blocks=64)
        engine.fill(seed=5)
        old = list(range(7000, 7000 + 2 * CHUNK + 1))
        engine.store("old", old, list(range(8)), 0, 2 * CHUNK)
        assert engine.lookup("hold", old) == 2 * CHUNK  # locks both chunks
        expected = engine.read_blocks(list(range(8)))
        # Six more chunks through a cache with room for three besides the locked two.
        for i in range(6):
            toks = list(range(100 * i, 100 * i + CHUNK + 1))
            engine.store(f"new{i}", toks, list(range(8 + 4 * i, 12 + 4 * i)), 0, CHUNK)
        s = stats(server.url)
        assert s["evictions"] == 3 and s["chunks"] == 5
        assert engine.lookup("check", old) == 2 * CHUNK  # locked chunks survived
        # Lock everything: a further store is skipped and reported, nothing is corrupted.
        for i in range(3, 6):
            assert engine.lookup(f"pin{i}", list(range(100 * i, 100 * i + CHUNK + 1))) == CHUNK
        engine.store("skipped", list(range(9000, 9000 + CHUNK + 1)), list(range(40, 44)), 0,
                     CHUNK)
        assert stats(server.url)["store_skipped_full_chunks"] == 1
        assert engine.retrieve("hold", old, list(range(50, 58)), 0, 2 * CHUNK) == set()
        import torch
        for a, b in zip(expected, engine.read_blocks(list(range(50, 58))), strict=True):
            assert torch.equal(a, b)
