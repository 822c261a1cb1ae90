import numpy as np
import pytest
from blake3 import blake3

from kvdepot import keys
from kvdepot.errors import InvalidRequest
from kvdepot.keys import (
    HASH_BYTES,
    chain_hashes,
    iter_prefix_keys,
    key_rank,
    rank_key,
    scope_root,
)
from kvdepot.native import chain_links
from kvdepot.protocol import KeyScope


def tokens(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def test_chain_is_deterministic_and_prefix_stable():
    seed = scope_root(KeyScope("m", 1))
    a = chain_hashes(seed, tokens(1024), 256, 4)
    b = chain_hashes(seed, tokens(768), 256, 3)
    assert a[:3] == b
    assert len(set(a)) == 4
    assert all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in a)


def test_a_changed_token_changes_that_chunk_and_every_later_one():
    seed = scope_root(KeyScope("m", 1))
    t = tokens(1024)
    base = chain_hashes(seed, t, 256, 4)
    t2 = t.copy()
    t2[300] += 1
    changed = chain_hashes(seed, t2, 256, 4)
    assert changed[0] == base[0]
    assert all(x != y for x, y in zip(changed[1:], base[1:], strict=True))


@pytest.mark.parametrize("other", [KeyScope("m2", 1), KeyScope("m", 2), KeyScope("m", 1, "s")])
def test_scope_separates_keys(other):
    t = tokens(256)
    assert (chain_hashes(scope_root(KeyScope("m", 1)), t, 256, 1)
            != chain_hashes(scope_root(other), t, 256, 1))


def test_scope_fields_do_not_run_together():
    assert scope_root(KeyScope("ab", 1, "c")) != scope_root(KeyScope("a", 1, "bc"))


def test_rank_suffix_roundtrip():
    h = b"\x01" * HASH_BYTES
    assert key_rank(rank_key(h, 7)) == 7
    assert rank_key(h, 0) != rank_key(h, 1)


@pytest.mark.parametrize("salt", ["a" * 513, "line\nbreak", "nul\x00"])
def test_bad_salts_are_rejected_with_a_reason(salt):
    with pytest.raises(InvalidRequest, match="cache_salt"):
        scope_root(KeyScope("m", 1, salt))


def test_too_few_tokens_is_an_error():
    with pytest.raises(InvalidRequest, match="tokens"):
        chain_hashes(scope_root(KeyScope("m", 1)), tokens(100), 256, 1)


def test_a_link_is_blake3_keyed_with_the_previous_link_over_blake3_of_the_chunk():
    seed = scope_root(KeyScope("m", 1))
    t = tokens(512)
    first = blake3(blake3(t[:256].tobytes()).digest(), key=seed).digest()
    second = blake3(blake3(t[256:].tobytes()).digest(), key=first).digest()
    assert chain_hashes(seed, t, 256, 2) == [first, second]


@pytest.mark.parametrize("num_chunks", [0, 1, 7, 8, 9, 24, 25, 130])
@pytest.mark.parametrize("world_size", [1, 3])
def test_prefix_keys_are_the_chain_with_every_rank_suffix(num_chunks, world_size):
    seed = scope_root(KeyScope("m", world_size))
    t = tokens(num_chunks * 16 + 5)
    expected = [[rank_key(h, r) for r in range(world_size)]
                for h in chain_hashes(seed, t, 16, num_chunks)]
    assert list(iter_prefix_keys(seed, t, 16, num_chunks, world_size)) == expected


def test_prefix_keys_hash_lazily():
    """A lookup that misses at its first chunk must not hash a 32k-token prompt."""
    seed = scope_root(KeyScope("m", 1))
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(keys, "chain_links", lambda *a: calls.append(a[3]) or chain_links(*a))
        it = iter_prefix_keys(seed, tokens(32768), 256, 128, 1)
        next(it)
    assert sum(calls) < 16
