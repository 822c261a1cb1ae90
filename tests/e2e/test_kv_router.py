"""The example router of issue 26 (testbed/kv_router.py): its index follows vLLM's events,
GPU and kvdepot media alike, and its prompt hashes are vLLM's."""

from __future__ import annotations

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils

from kvdepot.testbed.kv_router import PrefixIndex, prompt_hasher

BLOCK = 4


def stored(hashes: list, medium: str) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                       block_size=BLOCK, lora_id=None, medium=medium, lora_name=None)


def test_the_index_keeps_depot_blocks_when_vllms_own_cache_is_reset():
    index = PrefixIndex(2)
    index.apply(0, KVEventBatch(ts=0, events=[stored([1, 2, 3], "GPU"),
                                              stored([1, 2], "CPU")]))
    index.apply(1, KVEventBatch(ts=0, events=[stored([1], "GPU")]))
    assert index.prefix_blocks(0, [1, 2, 3, 4]) == 3
    assert index.prefix_blocks(1, [1, 2, 3, 4]) == 1
    index.apply(0, KVEventBatch(ts=0, events=[AllBlocksCleared()]))
    assert index.prefix_blocks(0, [1, 2, 3]) == 2  # the depot still holds two
    assert index.prefix_blocks(0, [1, 2, 3], frozenset({"GPU"})) == 0
    index.apply(0, KVEventBatch(ts=0, events=[BlockRemoved(block_hashes=[1], medium="CPU")]))
    assert index.prefix_blocks(0, [1, 2]) == 0 and index.blocks(0, "CPU") == 1


def test_prompt_hashes_are_vllms_as_its_events_carry_them():
    tokens = list(range(1000, 1000 + 3 * BLOCK + 2))
    kv_cache_utils.init_none_hash(sha256)
    expected, parent = [], None
    for start in range(0, 3 * BLOCK, BLOCK):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[start:start + BLOCK])
        expected.append(kv_cache_utils.maybe_convert_block_hash(parent))
    assert prompt_hasher(BLOCK)(tokens) == expected
    assert prompt_hasher(BLOCK)(tokens[:BLOCK - 1]) == []
