"""kvdepot's block events as vLLM's own KV events (`vllm.distributed.kv_events`), which the
engine publishes with those of its GPU blocks (`take_events`), for KV-aware routers.

A block kvdepot holds is reported under the engine's own block hash, so a router that
hashes a prompt as vLLM does finds it with no code of ours: `medium` says where it is
("CPU" or "DISK"), `ownership` that kvdepot holds it, `locality` that it is on this node.
`token_ids` is empty: the server keeps hashes, not prompts (docs/kv-events.md).
"""

from __future__ import annotations

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvdepot.protocol import BlockEvent

OWNERSHIP = "kvdepot"
LOCALITY = "LOCAL"
GROUP = 0
"""vLLM's first KV cache group: the block hashes are the request's, whatever the group."""


def vllm_events(events: list[BlockEvent]) -> list[KVCacheEvent]:
    converted: list[KVCacheEvent] = []
    for event in events:
        hashes = [maybe_convert_block_hash(h) for h in event.block_hashes]
        if event.stored:
            parent = event.parent_block_hash
            converted.append(BlockStored(
                block_hashes=hashes,
                parent_block_hash=maybe_convert_block_hash(parent) if parent else None,
                token_ids=[], block_size=event.block_size, lora_id=None, medium=event.medium,
                lora_name=None, group_idx=GROUP, locality=LOCALITY, ownership=OWNERSHIP))
        else:
            converted.append(BlockRemoved(block_hashes=hashes, medium=event.medium,
                                          group_idx=GROUP, locality=LOCALITY,
                                          ownership=OWNERSHIP))
    return converted
