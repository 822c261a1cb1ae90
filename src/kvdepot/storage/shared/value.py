"""How a chunk is laid out in a Redis/Valkey keyspace.

A chunk is one small head value and its payload cut into pieces of at most
`piece_bytes`, each under its own key, spread over the cluster's shards: reading or
writing a chunk keeps several shards busy at once, and no single command moves more than
one piece.

    kvdepot:<format>:<chunk key hex>              head: fields, checksum, layout fingerprint
    kvdepot:<format>:<chunk key hex>:<i>:{<tag>}  piece i of the payload

Each piece's hash tag places it in a chosen slot: a chunk's pieces sit evenly spaced
around the 16,384 slots, starting from its head's slot. A cluster gives each master a
contiguous range of slots, so every master holds its fair share of a chunk's pieces, give
or take one: a read or write waits for its busiest master, and with the slots left to the
hash that master carried on average 1.46 times its share of one chunk over three masters
(docs/shared-tier.md).

The head's fields are the magic, the key format (`FORMAT`), the fingerprint length,
the payload length, the piece size and count. The checksum is XXH3-128 over the chunk
key, the fields, the fingerprint and each piece's own XXH3-128 in order: a value copied
under another key, a flipped bit anywhere, pieces swapped, a missing or short piece, or a
head of another format never passes. Pieces are hashed one by one so that a reader
hashes each as it lands, while it is still in the CPU's cache, on the thread that
received it; hashing whole chunks once complete cost promotion 10-20 % more
(docs/shared-tier.md).

Why XXH3 and not a cryptographic hash: the checksum guards against damage and mix-ups
(an evicted piece, a value of another chunk, a torn write), not against someone who may
write to the cluster: with no secret in it, any hash can be recomputed by whoever forges
a value, so blake3 (format 1) protected no better, and cost every promotion a pass of
hashing that XXH3 does about eight times faster (docs/shared-tier.md). What stands
between tenants is the keys (scoped per tenant) and the cluster's ACL.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import xxhash
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from kvdepot.keys import ChunkKey

FORMAT = 3
"""Bumped whenever the layout of values or keys changes: old values are then simply
not found (and age out through their TTL). 2: XXH3-128 instead of blake3. 3: pieces
placed by hash tags, and hashed one by one."""
MAGIC = b"KVDR"
_FIELDS = struct.Struct("<4sBHQII")  # magic, format, fingerprint length, payload, piece, pieces
_DIGEST_BYTES = 16
HEAD_BYTES = _FIELDS.size + _DIGEST_BYTES
KEY_PREFIX = f"kvdepot:{FORMAT}:"


def head_key(key: ChunkKey) -> str:
    return KEY_PREFIX + key.hex()


def piece_keys(key: ChunkKey, pieces: int) -> list[str]:
    """The pieces' keys, whose hash tags space them evenly around the cluster's slots
    from the head's slot on."""
    base = head_key(key)
    first = key_slot(base.encode())
    slots = [(first + i * REDIS_CLUSTER_HASH_SLOTS // pieces) % REDIS_CLUSTER_HASH_SLOTS
             for i in range(pieces)]
    tags = _slot_tags()
    return [f"{base}:{i}:{{{tags[slot]}}}" for i, slot in enumerate(slots)]


def prepare_placement() -> None:
    """Derive the slot-tag table now (tens of ms, once per process): a tier calls this as
    it starts, so that no lookup's first read pays for it."""
    _slot_tags()


@functools.cache
def _slot_tags() -> tuple[str, ...]:
    """For every hash slot, a hash tag that lands in it: the smallest number, in
    decimal, that hashes there (every node derives the same table)."""
    tags: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    missing, number = REDIS_CLUSTER_HASH_SLOTS, 0
    while missing:
        text = str(number)
        slot = key_slot(text.encode())
        if tags[slot] is None:
            tags[slot] = text
            missing -= 1
        number += 1
    return tuple(tag for tag in tags if tag is not None)


def piece_count(payload_bytes: int, piece_bytes: int) -> int:
    return max(1, -(-payload_bytes // piece_bytes))


@dataclass(frozen=True, slots=True)
class Head:
    fingerprint: bytes
    payload_bytes: int
    piece_bytes: int
    pieces: int
    fields: bytes
    digest: bytes

    def piece_span(self, index: int) -> tuple[int, int]:
        start = index * self.piece_bytes
        return start, min(self.payload_bytes, start + self.piece_bytes)


def piece_digest(piece: memoryview) -> bytes:
    """One piece's own hash (XXH3-128; the hash lets go of the GIL for big pieces)."""
    return xxhash.xxh3_128_digest(piece)


def _checksum(key: ChunkKey, fields: bytes, fingerprint: bytes, digests: list[bytes]) -> bytes:
    digest = xxhash.xxh3_128(key)
    digest.update(fields)
    digest.update(fingerprint)
    digest.update(b"".join(digests))
    return digest.digest()


def _piece_digests(payload: memoryview, piece_bytes: int) -> list[bytes]:
    return [piece_digest(payload[start:start + piece_bytes])
            for start in range(0, max(1, len(payload)), piece_bytes)]


def encode_head(key: ChunkKey, fingerprint: bytes, payload: memoryview, piece_bytes: int
                ) -> tuple[bytes, int]:
    """The head value of a chunk and its piece count."""
    pieces = piece_count(len(payload), piece_bytes)
    fields = _FIELDS.pack(MAGIC, FORMAT, len(fingerprint), len(payload), piece_bytes, pieces)
    digests = _piece_digests(payload, piece_bytes)
    return fields + _checksum(key, fields, fingerprint, digests) + fingerprint, pieces


def decode_head(value: bytes) -> Head | None:
    """The head's fields, or None if it is not a head of this format (or is cut short)."""
    if len(value) < HEAD_BYTES:
        return None
    fields = value[:_FIELDS.size]
    magic, version, fp_len, payload, piece, pieces = _FIELDS.unpack(fields)
    if (magic != MAGIC or version != FORMAT or len(value) != HEAD_BYTES + fp_len or piece <= 0
            or pieces != piece_count(payload, piece)):
        return None
    return Head(fingerprint=value[HEAD_BYTES:], payload_bytes=payload, piece_bytes=piece,
                pieces=pieces, fields=fields, digest=value[_FIELDS.size:HEAD_BYTES])


def verify(key: ChunkKey, head: Head, payload: memoryview) -> bool:
    """Whether a whole payload at hand is the chunk's."""
    return verify_pieces(key, head, _piece_digests(payload, head.piece_bytes))


def verify_pieces(key: ChunkKey, head: Head, digests: list[bytes]) -> bool:
    """Whether pieces whose `piece_digest`s are `digests`, in order, are the chunk's."""
    return (len(digests) == head.pieces
            and _checksum(key, head.fields, head.fingerprint, digests) == head.digest)
