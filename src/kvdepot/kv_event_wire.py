"""The KV events wire format: what `kvdepot serve --kv-events` publishes about the chunks
entering and leaving its tiers, for KV-aware routers (docs/kv-events.md).

Shared by the server's publisher and the subscriber client, so it imports nothing of
either. Every event is a msgpack array whose first element is its tag; a batch is
`[timestamp, [event, ...], dropped]`.
"""

from __future__ import annotations

import struct

import msgspec

TOPIC = b"kvdepot"
SEQUENCE = struct.Struct(">q")
"""A batch's sequence number on the wire: 8 bytes, big-endian, from 0 at every start."""
REPLAY_END = -1
"""The sequence number of the empty message that ends a replay."""
ALL_TIERS = ""
"""`AllChunksCleared.tier` for every tier at once."""


class ChunkStored(msgspec.Struct, array_like=True, tag="stored", frozen=True):
    """Chunks that entered `tier`, consecutive in one prompt (each the next one's parent)."""

    chunk_hashes: list[bytes]
    """Chain hashes (32 bytes each; `kvdepot.keys.chain_hashes` of the prompt's tokens under
    the scope root of model, world size, salt and tenant)."""
    parent_hash: bytes | None
    """The chain hash before the first one; None for a prompt's first chunk, or unknown
    (chunks found on disk at start)."""
    tokens_per_chunk: int
    tier: str
    rank: int
    """The KV rank whose slice this is (a prefix is usable when every rank holds it)."""
    tenant: str
    model: str
    """Empty when unknown (chunks found on disk at start)."""


class ChunkRemoved(msgspec.Struct, array_like=True, tag="removed", frozen=True):
    chunk_hashes: list[bytes]
    tier: str
    rank: int
    tenant: str


class AllChunksCleared(msgspec.Struct, array_like=True, tag="cleared", frozen=True):
    """Forget everything known about `tier` (`ALL_TIERS`: about this server); published
    first at every start."""

    tier: str


KVEvent = ChunkStored | ChunkRemoved | AllChunksCleared


class EventBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    """Wall-clock seconds when the batch was sent."""
    events: list[KVEvent]
    dropped: int = 0
    """Events the server dropped since the previous batch (its queue was full): an index
    built from the events may hold chunks that are gone or miss chunks that are there."""


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(EventBatch)
