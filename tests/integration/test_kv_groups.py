"""Engines with several KV cache groups (vLLM's hybrid KV cache manager), through the
seed-compatible adapters: one block list per group, chunks carrying every group."""

import pytest
import torch

from kvdepot.client.admin import AdminClient
from kvdepot.protocol import NO_BLOCK

CHUNK = 64  # the server fixture's chunk size; 16-token blocks: 4 per chunk
TOKENS = list(range(2000, 2000 + 3 * CHUNK))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_every_group_round_trips_and_unheld_blocks_are_not_written(engines, server):
    writer, reader = engines(groups=2), engines(groups=2)
    writer.fill(seed=21)
    # Groups number blocks independently; in vLLM they come from one pool.
    full, window = list(range(0, 8)), list(range(8, 16))
    writer.store("w", TOKENS, [full, window], 0, 2 * CHUNK)
    reader.write_through_old_view(0.0)
    assert reader.lookup("r", TOKENS[:2 * CHUNK]) == 2 * CHUNK
    # All but the last token; the window group holds only its last 5 blocks.
    dst_full = list(range(16, 24))
    dst_window = [NO_BLOCK] * 3 + list(range(27, 32))
    errors = reader.retrieve("r", TOKENS, [dst_full, dst_window], 0, 2 * CHUNK - 1)
    assert errors == set()
    assert same(writer.read_blocks(full), reader.read_blocks(dst_full))
    assert same(writer.read_blocks(window[3:]), reader.read_blocks(dst_window[3:]))
    written = set(dst_full) | set(dst_window[3:])
    assert reader.blocks_hold([b for b in range(32) if b not in written], 0.0)
    with AdminClient(server.url) as admin:
        stats = admin.stats()
    assert stats["stored_chunks"] == 2 and stats["retrieved_chunks"] == 2


def test_a_one_group_engine_cannot_read_chunks_of_two(engines):
    writer, reader = engines(groups=2), engines()
    writer.fill(seed=22)
    writer.store("w", TOKENS, [list(range(4)), list(range(4, 8))], 0, CHUNK)
    assert reader.lookup("r", TOKENS[:CHUNK]) == CHUNK  # same model, same keys
    assert reader.retrieve("r", TOKENS, list(range(8, 12)), 0, CHUNK) == set(range(8, 12))


@pytest.mark.parametrize("case", ["one_list_for_two_groups", "unheld_in_a_store",
                                  "unheld_after_a_held_block", "short_second_list"])
def test_bad_group_block_lists_move_nothing(engines, server, case):
    writer, reader = engines(groups=2), engines(groups=2)
    writer.fill(seed=23)
    writer.store("w", TOKENS, [list(range(4)), list(range(4, 8))], 0, CHUNK)
    reader.write_through_old_view(0.0)
    with AdminClient(server.url) as admin:
        before = admin.stats()
    if case == "unheld_in_a_store":
        reader.fill(seed=24)
        reader.store("bad", TOKENS, [list(range(4, 8)), [NO_BLOCK, 9, 10, 11]], CHUNK,
                     2 * CHUNK)
        assert reader.lookup("r2", TOKENS) == CHUNK  # chunk 1 was not stored
        with AdminClient(server.url) as admin:
            assert admin.stats()["store_errors"] == before["store_errors"] + 1
        return
    blocks = {
        "one_list_for_two_groups": list(range(20, 24)),
        "unheld_after_a_held_block": [list(range(20, 24)), [24, NO_BLOCK, 26, 27]],
        "short_second_list": [list(range(20, 24)), [24, 25]],
    }[case]
    errors = reader.retrieve("r", TOKENS, blocks, 0, CHUNK)
    flat = blocks if isinstance(blocks[0], int) else [b for g in blocks for b in g]
    assert errors == {b for b in flat if b != NO_BLOCK}
    assert reader.blocks_hold(list(range(32)), 0.0)


@pytest.mark.parametrize("hints, message", [
    ({"per_layer_kv_cache_group_id": [0]}, "has 1 entries"),
    ({"per_layer_kv_cache_group_id": [0, -1, 0]}, "belong to no KV cache group"),
    ({"per_layer_logical_block_size": [16, 32, 16]}, "one block size"),
])
def test_layout_hints_that_do_not_fit_are_refused_at_registration(engines, hints, message):
    with pytest.raises(Exception, match=message):
        engines(groups=1, num_layers=2, layout_hints=hints)


def test_unknown_layout_hints_are_ignored(engines):
    engine = engines(groups=1, num_layers=2, layout_hints={"kv_layout": "NHD"})
    engine.fill(seed=25)
    engine.store("w", TOKENS, list(range(4)), 0, CHUNK)
    assert engine.lookup("r", TOKENS[:CHUNK]) == CHUNK
