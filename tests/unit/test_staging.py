"""The staging area's parts that need no server: the mirror of a KV cache the server must
read as the same chunk format, the move of staged blocks, and the slots' bookkeeping.
(Staged loads end to end, through vLLM's own scheduler: `tests/vllm_releases`.)"""

from __future__ import annotations

import pytest
import torch

from kvdepot.integrations.vllm.staging import SlotRanges, mirror_caches, move_blocks, move_plan
from tests.support.layouts import LAYOUTS, make_kv_caches
from tests.unit.test_layout import describe

BS = 16


def _head_major(num_blocks: int) -> dict[str, torch.Tensor]:
    """vLLM's flash-attention shape over memory in another order: `[2, blocks, heads,
    block_size, dim]` views of `[2, blocks, block_size, heads, dim]` allocations."""
    return {f"layers.{i}.attn": torch.zeros(2, num_blocks, BS, 4, 8).permute(0, 1, 3, 2, 4)
            for i in range(2)}


CACHES = {**{name: lambda n, name=name: make_kv_caches(name, num_layers=3, num_blocks=n,
                                                       block_size=BS) for name in LAYOUTS},
          "head_major": _head_major}


@pytest.mark.parametrize("layout", CACHES)
def test_the_staging_cache_holds_chunks_in_the_caches_format(layout: str) -> None:
    caches = CACHES[layout](12)
    staged, pairs = mirror_caches(caches, BS, 5)
    assert staged.keys() == caches.keys()
    assert describe(staged)[0].fingerprint == describe(caches)[0].fingerprint
    assert describe(staged)[0].num_blocks == 5
    # Names that alias one view share one staging tensor, moved once.
    assert staged["layers.0.attn"] is staged.get("layers.shared.attn", staged["layers.0.attn"])
    assert len(pairs) == len({(t.data_ptr(), t.shape, t.stride()) for t in caches.values()})


@pytest.mark.parametrize("planned", [True, False], ids=["word_rows", "along_the_block_axis"])
@pytest.mark.parametrize("layout", CACHES)
def test_a_move_writes_exactly_the_named_blocks_from_their_slots(layout: str,
                                                                 planned: bool) -> None:
    """Both ways a move copies: the plan's word rows, and a pair as it is (the plan's
    fallback)."""
    caches = CACHES[layout](12)
    _, pairs = mirror_caches(caches, BS, 6)
    generator = torch.Generator().manual_seed(4)
    for cache, staging, _ in pairs:
        cache.copy_(torch.randn(cache.shape, generator=generator))
        staging.copy_(torch.randn(staging.shape, generator=generator))
    before = [cache.clone() for cache, _, _ in pairs]
    move_blocks(move_plan(pairs) if planned else pairs, 2, [9, 0, 4])
    for (cache, staging, axis), old in zip(pairs, before, strict=True):
        for block in range(12):
            want = {9: staging.select(axis, 2), 0: staging.select(axis, 3),
                    4: staging.select(axis, 4)}.get(block, old.select(axis, block))
            assert torch.equal(cache.select(axis, block), want), block


@pytest.mark.parametrize("layout", CACHES)
def test_every_layout_moves_whole_words_of_whole_blocks(layout: str) -> None:
    """The move's fast path, taken for every layout vLLM hands over: `[blocks, words]`
    views copied along axis 0 (one per K and V where they lie outside the blocks), never
    element by element along another axis."""
    caches = CACHES[layout](12)
    _, pairs = mirror_caches(caches, BS, 6)
    plan = move_plan(pairs)
    outside = {"flash_attn": 2, "head_major": 2}.get(layout, 1)
    assert len(plan) == len(pairs) * outside
    for cache, staged, axis in plan:
        assert axis == 0 and cache.dim() == staged.dim() == 2
        # Every layout's block row here is a multiple of 8 bytes: the widest word.
        assert cache.dtype == staged.dtype == torch.int64
        assert cache.shape[1] == staged.shape[1] and staged.shape[0] == 6


def test_runs_of_slots_never_overlap_and_come_back_when_released() -> None:
    slots = SlotRanges(10)
    assert slots.reserve("a", 4) == 0
    assert slots.reserve("b", 3) == 4
    assert slots.reserve("c", 4) is None  # 3 free, not 4
    assert "c" not in slots
    slots.release("a")
    assert slots.reserve("c", 2) == 0  # the first gap that fits
    assert slots.reserve("d", 3) == 7
    assert slots.reserve("e", 1) == 2
    assert slots.reserve("f", 2) is None
    # Reserving again replaces the owner's run.
    assert slots.reserve("b", 1) == 3
    assert slots.reserve("g", 3) == 4
    assert slots.reserve("h", 0) is None and slots.reserve("i", 11) is None
