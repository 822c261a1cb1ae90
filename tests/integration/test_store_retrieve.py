"""Stores in one engine process, lookups and retrieves in another, bytes compared."""

import time

import pytest
import torch

from kvdepot.client.admin import AdminClient
from tests.support.layouts import LAYOUTS

CHUNK = 64  # the server fixture's chunk size; engines use 16-token blocks: 4 per chunk
TOKENS = list(range(1000, 1000 + 5 * CHUNK + 10))  # 5 full chunks and a tail


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_survive_a_round_trip_between_processes(engines, server, layout):
    writer, reader = engines(layout=layout), engines(layout=layout)
    writer.fill(seed=11)
    src = list(range(3, 23))  # 20 blocks = 5 chunks
    writer.store("w1", TOKENS, src, 0, 5 * CHUNK)
    assert reader.lookup("r1", TOKENS) == 5 * CHUNK
    dst = list(range(31, 11, -1))
    assert reader.retrieve("r1", TOKENS, dst, 0, 5 * CHUNK) == set()
    assert_same(writer.read_blocks(src), reader.read_blocks(dst))
    untouched = [b for b in range(32) if b not in dst]
    assert all(bool((t == 0).all()) for t in reader.read_blocks(untouched))
    with AdminClient(server.url) as admin:
        stats = admin.stats()
    assert stats["stored_chunks"] == 5 and stats["retrieved_chunks"] == 5
    assert stats["hit_tokens"] == 5 * CHUNK


def test_register_keeps_existing_views_working(engines):
    engine = engines(layout="vllm_cpu")
    engine.write_through_old_view(3.0)
    engine.store("w", TOKENS, list(range(4)), 0, CHUNK)
    engine.write_through_old_view(0.0)
    assert engine.retrieve("r", TOKENS, list(range(4, 8)), 0, CHUNK) == set()
    assert all(bool((t == 3.0).all()) for t in engine.read_blocks(list(range(4, 8))))


def test_partial_prefix_hit(engines):
    writer, reader = engines(), engines()
    writer.fill(seed=1)
    writer.store("w", TOKENS, list(range(12)), 0, 3 * CHUNK)
    # Same document start, different continuation after two chunks.
    other = TOKENS[:2 * CHUNK] + [7] * (3 * CHUNK)
    assert reader.lookup("r", other) == 2 * CHUNK
    assert reader.lookup("r-full", TOKENS) == 3 * CHUNK
    # A different first token shares nothing (keys chain over the whole prefix).
    assert reader.lookup("r-none", [5, *TOKENS[1:]]) == 0


def test_store_of_later_chunks_extends_the_prefix(engines):
    engine = engines()
    engine.fill(seed=4)
    engine.store("w", TOKENS, list(range(8)), 0, 2 * CHUNK)
    engine.store("w2", TOKENS, list(range(8, 12)), 2 * CHUNK, 3 * CHUNK)
    assert engine.lookup("r", TOKENS) == 3 * CHUNK
    # A hole breaks the prefix: chunk 4 stored without chunk 3 does not count.
    engine.store("w3", TOKENS, list(range(16, 20)), 4 * CHUNK, 5 * CHUNK)
    assert engine.lookup("r2", TOKENS) == 3 * CHUNK


def test_lookup_answers_every_whole_chunk_held(engines):
    engine = engines()
    exact = TOKENS[:2 * CHUNK]
    engine.store("w", exact, list(range(8)), 0, 2 * CHUNK)
    # A prompt of exactly two chunks hits both: the engine decides what it loads.
    assert engine.lookup("r", exact) == 2 * CHUNK
    assert engine.lookup("r2", [*exact, 1]) == 2 * CHUNK
    assert engine.lookup("r3", exact[:2 * CHUNK - 1]) == CHUNK
    # Shorter than one chunk: nothing to look up, nothing sent.
    assert engine.lookup("r4", exact[:CHUNK - 1]) == 0
    assert engine.lookup("r5", exact[:CHUNK]) == CHUNK


def test_retrieve_ending_inside_a_chunk_writes_only_the_blocks_before_its_end(engines, server):
    writer, reader = engines(), engines()
    writer.fill(seed=12)
    exact = TOKENS[:2 * CHUNK]
    writer.store("w", exact, list(range(8)), 0, 2 * CHUNK)
    reader.write_through_old_view(0.0)
    assert reader.lookup("r", exact) == 2 * CHUNK
    # All but the last 20 tokens: the first 7 of the 8 blocks hold them.
    dst = list(range(20, 27))
    assert reader.retrieve("r", exact, dst, 0, 2 * CHUNK - 20) == set()
    assert_same(writer.read_blocks(list(range(7))), reader.read_blocks(dst))
    untouched = [b for b in range(32) if b not in dst]
    assert all(bool((t == 0).all()) for t in reader.read_blocks(untouched))
    with AdminClient(server.url) as admin:
        stats = admin.stats()
    # Both chunks were read, and every lock of the lookup is given back.
    assert stats["retrieved_chunks"] == 2 and stats["locked_chunks"] == 0


def test_retrieve_one_token_short_of_a_chunk_with_a_shared_first_block(engines):
    writer, reader = engines(), engines()
    writer.fill(seed=13)
    exact = TOKENS[:2 * CHUNK]
    writer.store("w", exact, list(range(8)), 0, 2 * CHUNK)
    reader.write_through_old_view(0.0)
    assert reader.lookup("r", exact) == 2 * CHUNK
    # The engine's own cache holds all but the last block; the rest is topped up.
    dst = list(range(10, 14))
    errors = reader.retrieve("r", exact, dst, CHUNK, 2 * CHUNK - 1, skip=3 * 16)
    assert errors == set()
    assert all(bool((t == 0).all()) for t in reader.read_blocks(dst[:3]))
    assert_same(writer.read_blocks([7]), reader.read_blocks(dst[3:]))


def test_a_store_ending_inside_a_chunk_is_refused(engines, server):
    engine = engines()
    engine.fill(seed=15)
    other = [7] * (2 * CHUNK)
    engine.store("bad", other, list(range(8)), 0, 2 * CHUNK - 1)  # reported, nothing stored
    assert engine.lookup("r", other) == 0
    with AdminClient(server.url) as admin:
        stats = admin.stats()
    assert stats["store_errors"] == 1 and stats["chunks"] == 0


@pytest.mark.parametrize("case", ["tokens_short_of_the_chunk", "short_block_list",
                                  "missing_last_chunk"])
def test_partial_last_chunk_errors_write_nothing(engines, case):
    writer, reader = engines(), engines()
    writer.fill(seed=14)
    exact = TOKENS[:2 * CHUNK]
    stored = exact if case != "missing_last_chunk" else exact[:CHUNK]
    writer.store("w", stored, list(range(4 * len(stored) // CHUNK)), 0, len(stored))
    reader.write_through_old_view(0.0)
    dst = list(range(20, 28))
    tokens = exact[:2 * CHUNK - 1] if case == "tokens_short_of_the_chunk" else exact
    blocks = dst[:6] if case == "short_block_list" else dst
    errors = reader.retrieve("r", tokens, blocks, 0, 2 * CHUNK - 1)
    assert errors == set(blocks)
    assert all(bool((t == 0).all()) for t in reader.read_blocks(list(range(32))))


def test_cache_salt_isolates_entries(engines):
    engine = engines()
    engine.fill(seed=5)
    engine.store("w", TOKENS, list(range(8)), 0, 2 * CHUNK, salt="tenant-a")
    assert engine.lookup("a", TOKENS, salt="tenant-a") == 2 * CHUNK
    assert engine.lookup("b", TOKENS, salt="tenant-b") == 0
    assert engine.lookup("none", TOKENS) == 0
    errors = engine.retrieve("rb", TOKENS, list(range(8, 16)), 0, 2 * CHUNK, salt="tenant-b")
    assert errors == set(range(8, 16))


def test_models_do_not_share_entries(engines):
    a, b = engines(model="model-a"), engines(model="model-b")
    a.store("w", TOKENS, list(range(4)), 0, CHUNK)
    assert a.lookup("ra", TOKENS) == CHUNK
    assert b.lookup("rb", TOKENS) == 0


def test_storing_an_existing_chunk_is_harmless(engines, server):
    engine = engines()
    engine.fill(seed=6)
    engine.store("w", TOKENS, list(range(4)), 0, CHUNK)
    original = engine.read_blocks(list(range(4)))
    engine.fill(seed=7)  # different bytes under the same tokens
    engine.store("w2", TOKENS, list(range(4)), 0, CHUNK)
    assert engine.retrieve("r", TOKENS, list(range(4, 8)), 0, CHUNK) == set()
    assert_same(original, engine.read_blocks(list(range(4, 8))))
    with AdminClient(server.url) as admin:
        assert admin.stats()["store_present_chunks"] == 1


def test_skip_first_n_tokens_leaves_shared_blocks_alone(engines):
    writer, reader = engines(), engines()
    writer.fill(seed=8)
    writer.store("w", TOKENS, list(range(8)), 0, 2 * CHUNK)
    reader.write_through_old_view(0.0)
    dst = list(range(8, 16))
    # The engine's own prefix cache holds the first 5 blocks (80 tokens).
    assert reader.retrieve("r", TOKENS, dst, 0, 2 * CHUNK, skip=80) == set()
    assert all(bool((t == 0).all()) for t in reader.read_blocks(dst[:5]))
    assert_same(writer.read_blocks(list(range(5, 8))), reader.read_blocks(dst[5:]))


def test_retrieve_of_a_later_range_only(engines):
    writer, reader = engines(), engines()
    writer.fill(seed=9)
    writer.store("w", TOKENS, list(range(12)), 0, 3 * CHUNK)
    assert reader.retrieve("r", TOKENS, list(range(20, 24)), 2 * CHUNK, 3 * CHUNK) == set()
    assert_same(writer.read_blocks(list(range(8, 12))), reader.read_blocks(list(range(20, 24))))


def test_hit_chunk_gone_by_load_time_fails_the_whole_load(engines, server):
    writer, reader = engines(), engines()
    writer.fill(seed=16)
    exact = TOKENS[:2 * CHUNK]
    writer.store("w", exact, list(range(8)), 0, 2 * CHUNK)
    reader.write_through_old_view(0.0)
    assert reader.lookup("r", exact) == 2 * CHUNK
    # The promise is broken behind the engine's back: its locks go (as at the TTL) and
    # the chunks with them.
    reader.call("scheduler", "end_session", "r")
    with AdminClient(server.url) as admin:
        deadline = time.monotonic() + 10
        while admin.stats()["lookup_jobs"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert admin.clear() == 2
    dst = list(range(20, 28))
    assert reader.retrieve("r", exact, dst, 0, 2 * CHUNK - 1) == set(dst)
    assert all(bool((t == 0).all()) for t in reader.read_blocks(list(range(32))))


def test_retrieve_seconds_count_the_servers_time_on_each_retrieve(engines, server):
    writer, reader = engines(), engines()
    writer.fill(seed=5)
    writer.store("w", TOKENS, list(range(3, 23)), 0, 5 * CHUNK)
    assert reader.lookup("r", TOKENS) == 5 * CHUNK
    with AdminClient(server.url) as admin:
        before = admin.stats()
        started = time.perf_counter()
        assert reader.retrieve("r", TOKENS, list(range(3, 23)), 0, 5 * CHUNK) == set()
        elapsed = time.perf_counter() - started
        after = admin.stats()
    assert after["retrieves"] == before["retrieves"] + 1
    assert 0 < after["retrieve_seconds"] - before["retrieve_seconds"] < elapsed
