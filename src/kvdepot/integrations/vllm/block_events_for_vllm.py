"""kvdepot's block events as vLLM's own KV events (`vllm.distributed.kv_events`), which the
engine publishes with those of its GPU blocks (`take_events`), for KV-aware routers.

A block kvdepot holds is reported under the engine's own block hash, so a router that
hashes a prompt as vLLM does finds it with no code of ours: `medium` says where it is, in
the running vLLM's own words (`MEDIA`), `ownership` that kvdepot holds it, `locality` that
it is on this node. `token_ids` is empty: the server keeps hashes, not prompts
(docs/kv-events.md).

The event classes gained fields over the releases (`ownership` in 0.29), and a msgspec
struct refuses a keyword it does not declare: only the fields the running release declares
are passed, so a release without one still gets every event, less that field.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed import kv_events as vllm_kv_events
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvdepot.protocol import BlockEvent

OWNERSHIP = "kvdepot"
LOCALITY = "LOCAL"
GROUP = 0
"""vLLM's first KV cache group: the block hashes are the request's, whatever the group."""


def _storage_medium() -> str:
    """vLLM's name for a file tier: `MEDIUM_STORAGE` ("STORAGE") from 0.27 on; 0.26 named
    its file-system tier `MEDIUM_FS` ("FS") and had no other."""
    for name in ("MEDIUM_STORAGE", "MEDIUM_FS"):
        value = getattr(vllm_kv_events, name, None)
        if isinstance(value, str):
            return value
    return "STORAGE"


MEDIA = {"CPU": getattr(vllm_kv_events, "MEDIUM_CPU", "CPU"), "DISK": _storage_medium()}
"""The server's tiers (kvdepot's wire names, `BlockEvent.medium`) in vLLM's constants: CPU
memory is vLLM's CPU medium, the disk tier its storage medium."""

_STORED_FIELDS = frozenset(BlockStored.__struct_fields__)
_REMOVED_FIELDS = frozenset(BlockRemoved.__struct_fields__)


def _declared(fields: frozenset[str], values: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in values.items() if name in fields}


def vllm_events(events: list[BlockEvent]) -> list[KVCacheEvent]:
    converted: list[KVCacheEvent] = []
    for event in events:
        hashes = [maybe_convert_block_hash(h) for h in event.block_hashes]
        medium = MEDIA.get(event.medium, event.medium)
        common = {"block_hashes": hashes, "medium": medium, "group_idx": GROUP,
                  "locality": LOCALITY, "ownership": OWNERSHIP}
        if event.stored:
            parent = event.parent_block_hash
            converted.append(BlockStored(**_declared(_STORED_FIELDS, {
                **common, "token_ids": [], "block_size": event.block_size, "lora_id": None,
                "lora_name": None,
                "parent_block_hash": maybe_convert_block_hash(parent) if parent else None})))
        else:
            converted.append(BlockRemoved(**_declared(_REMOVED_FIELDS, common)))
    return converted
