"""Stores in one engine process, lookups and retrieves in another, bytes compared."""

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


def test_lookup_is_a_strict_prefix(engines):
    engine = engines()
    exact = TOKENS[:2 * CHUNK]
    engine.store("w", exact, list(range(8)), 0, 2 * CHUNK)
    # The engine must compute the last token itself: a fully cached prompt hits one chunk less.
    assert engine.lookup("r", exact) == CHUNK
    assert engine.lookup("r2", [*exact, 1]) == 2 * CHUNK


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
