"""Chunk keys: chained blake3 hashes of token chunks, scoped by model, world size and salt.

A chunk's hash covers its own tokens and, through the previous chunk's hash, every
token before it, so a key names a whole prefix. The scope (model, KV world size,
cache_salt) is the chain's root; the vLLM connector's model names the weights, not only
the model's name (`integrations/vllm/model_identity.py`), so KV of other weights served
under the same name never matches; the KV rank is a 2-byte suffix, so checking that a chunk
is present on every rank does not rehash anything. Keys are plain `bytes`: cheap to
hash and compare, and no tuples of Python objects on the hot path.

A tail (a prompt's tokens past its last whole chunk) is keyed like a chunk, from the
previous chunk's hash over its own tokens, and its key carries its length after the rank:
no other prompt can match it, nothing chains from it, and a tier tells a tail from a
whole chunk by its key alone.

A recurrent layer's state after a chunk (`state_key`) hangs off that chunk's chain hash:
it depends on exactly the tokens the chain names, and only a lookup that found the
chunk can find it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
from blake3 import blake3

from kvdepot.errors import InvalidRequest
from kvdepot.native import chain_links
from kvdepot.protocol import MAX_SALT_CHARS, KeyScope

ChunkKey = bytes

_DOMAIN = b"kvdepot/chunk-key/v3"
_STATE_DOMAIN = b"kvdepot/recurrent-state/v1"
HASH_BYTES = 32
MAX_RANKS = 1 << 16
_RANK_BYTES = 2
_TAIL_LENGTH_BYTES = 2
_FIRST_BATCH = 8


def _first_unprintable(text: str) -> int:
    return next(i for i, c in enumerate(text) if not c.isprintable())


def validate_cache_salt(salt: str) -> None:
    if len(salt) > MAX_SALT_CHARS:
        raise InvalidRequest(
            f"cache_salt is {len(salt)} characters long; at most {MAX_SALT_CHARS} are allowed"
        )
    if not salt.isprintable():
        raise InvalidRequest(
            # The salt itself stays out of the message: errors are logged, and salts are
            # secrets (docs/security.md).
            "cache_salt must consist of printable characters (no control characters, "
            f"newlines or NUL); the first one at index {_first_unprintable(salt)} is not"
        )


def scope_root(scope: KeyScope, tenant: str = "") -> bytes:
    """The chain's root (the link before the first chunk); different scopes never produce
    the same keys. `tenant` comes from the server (the caller's credential), never from
    the request: chunks of different tenants never share a key."""
    validate_cache_salt(scope.cache_salt)
    if scope.world_size < 1 or scope.world_size > MAX_RANKS:
        raise InvalidRequest(f"world_size must be in [1, {MAX_RANKS}], got {scope.world_size}")
    h = blake3(_DOMAIN)
    fields = [scope.model.encode(), str(scope.world_size).encode(), scope.cache_salt.encode()]
    if tenant:  # a fourth field: no tenant keeps the keys of a server without tenants
        fields.append(tenant.encode())
    for field in fields:
        # Length-prefix each field so ("ab", "c") and ("a", "bc") differ.
        h.update(len(field).to_bytes(4, "little"))
        h.update(field)
    return h.digest()


def _chunk_bytes(tokens: np.ndarray, chunk_size: int, num_chunks: int) -> memoryview:
    if num_chunks * chunk_size > len(tokens):
        raise InvalidRequest(
            f"{num_chunks} chunks of {chunk_size} tokens need {num_chunks * chunk_size} "
            f"tokens; only {len(tokens)} were sent"
        )
    return memoryview(np.ascontiguousarray(tokens, dtype="<i4")).cast("B")


def chain_hashes(root: bytes, tokens: np.ndarray, chunk_size: int, num_chunks: int) -> list[bytes]:
    """Hashes of the first `num_chunks` full chunks of `tokens` (int32 array).

    A link is blake3 keyed with the previous link (32 bytes, a blake3 key's size), over
    blake3 of the chunk's tokens (`kvdepot.native.chain_links`)."""
    data = _chunk_bytes(tokens, chunk_size, num_chunks)
    return chain_links(root, data, chunk_size * 4, num_chunks)


def iter_prefix_keys(root: bytes, tokens: np.ndarray, chunk_size: int, num_chunks: int,
                     world_size: int) -> Iterator[list[ChunkKey]]:
    """Per chunk of `chain_hashes`, its key on every rank; lazily, so that a lookup stops
    hashing soon after its first miss.

    Links are made in batches that double in size: a miss at the first chunk costs a few
    chunks' hashing, a hit of a whole long prompt a handful of calls."""
    data = _chunk_bytes(tokens, chunk_size, num_chunks)
    step = chunk_size * 4
    suffixes = [r.to_bytes(2, "little") for r in range(world_size)]
    only = suffixes[0] if world_size == 1 else None  # the common case, without a loop per chunk
    prev, done, batch = root, 0, _FIRST_BATCH
    while done < num_chunks:
        count = min(batch, num_chunks - done)
        links = chain_links(prev, data[done * step:], step, count)
        for link in links:
            yield [link + only] if only is not None else [link + s for s in suffixes]
        prev, done, batch = links[-1], done + count, batch * 2


def rank_key(chain_hash: bytes, rank: int) -> ChunkKey:
    return chain_hash + rank.to_bytes(_RANK_BYTES, "little")


def key_rank(key: ChunkKey) -> int:
    return int.from_bytes(key[HASH_BYTES:HASH_BYTES + _RANK_BYTES], "little")


def state_key(chain_hash: bytes, rank: int) -> ChunkKey:
    """The key on `rank` of the recurrent state after the chunk whose chain hash is
    `chain_hash`. Chunk and tail hashes are BLAKE3 keyed with the link before them; this
    one is unkeyed BLAKE3 of a domain and the hash, so it is never any chunk's or tail's."""
    return rank_key(blake3(_STATE_DOMAIN + chain_hash).digest(), rank)


def tail_hash(parent: bytes, tokens: np.ndarray) -> bytes:
    """The hash of a tail: `tokens` (int32, fewer than a chunk) after the chunk whose
    chain hash is `parent` (the scope root at a prompt's start), linked as a chunk is. A
    whole chunk hashes a chunk's worth of tokens, a tail fewer, so on one server the two
    never share a hash; their keys differ in any case (`tail_key`)."""
    data = memoryview(np.ascontiguousarray(tokens, dtype="<i4")).cast("B")
    return chain_links(parent, data, len(data), 1)[0]


def tail_key(hash_: bytes, rank: int, tokens: int) -> ChunkKey:
    """A tail's key on `rank`: its hash, the rank, and its length in tokens."""
    return (hash_ + rank.to_bytes(_RANK_BYTES, "little")
            + tokens.to_bytes(_TAIL_LENGTH_BYTES, "little"))


def tail_tokens(key: ChunkKey) -> int:
    """A tail key's length in tokens; 0 for the key of a whole chunk."""
    return int.from_bytes(key[HASH_BYTES + _RANK_BYTES:], "little")


def tail_keys(parent: bytes, tokens: np.ndarray, at: int, lengths: list[int],
              ranks: Iterable[int]) -> list[list[ChunkKey]]:
    """Per length in `lengths`, the keys on `ranks` of the tail of that many tokens from
    token `at` after the chunk whose chain hash is `parent`."""
    ranks = list(ranks)
    out = []
    for length in lengths:
        h = tail_hash(parent, tokens[at:at + length])
        out.append([tail_key(h, rank, length) for rank in ranks])
    return out
