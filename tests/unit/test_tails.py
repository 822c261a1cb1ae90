"""Tails in keys, CPU memory and promotion: how they are keyed, found, evicted and
brought up, on the classes themselves."""

from __future__ import annotations

import numpy as np
import torch

from kvdepot.keys import (
    chain_hashes,
    key_rank,
    rank_key,
    tail_hash,
    tail_key,
    tail_keys,
    tail_tokens,
)
from kvdepot.storage.cpu_tier import CPUTier, ReserveOutcome
from kvdepot.storage.lower_tiers import LowerTiers
from tests.unit.test_promotion import DictTier

ROOT = bytes(32)
PAGE = 4096
TOKENS = np.arange(1000, 1000 + 300, dtype=np.int32)


def parent_of(chunks: int) -> bytes:
    return chain_hashes(ROOT, TOKENS, 64, chunks)[-1] if chunks else ROOT


def test_a_tail_key_names_its_tokens_its_prefix_and_its_length():
    key = tail_key(tail_hash(ROOT, TOKENS[:32]), 3, 32)
    assert tail_tokens(key) == 32 and key_rank(key) == 3
    assert tail_tokens(rank_key(parent_of(1), 3)) == 0  # a whole chunk's key
    # Another token or another parent: another hash.
    other = TOKENS[:32].copy()
    other[-1] += 1
    assert tail_hash(ROOT, other) != tail_hash(ROOT, TOKENS[:32])
    assert tail_hash(parent_of(1), TOKENS[64:96]) != tail_hash(ROOT, TOKENS[64:96])
    # Tails are shorter than a chunk; even one of a chunk's length (a server with
    # smaller chunks) has a key of its own.
    whole = chain_hashes(ROOT, TOKENS, 64, 1)[0]
    assert tail_key(tail_hash(ROOT, TOKENS[:64]), 0, 64) != rank_key(whole, 0)
    keys = tail_keys(ROOT, TOKENS, 0, [48, 16], range(2))
    assert [[tail_tokens(k), key_rank(k)] for ks in keys for k in ks] == [
        [48, 0], [48, 1], [16, 0], [16, 1]]


def put(tier: CPUTier, key: bytes, nbytes: int, parent: bytes | None = None) -> ReserveOutcome:
    outcome, chunk = tier.reserve(key, nbytes, b"fp", parent=parent)
    if chunk is not None:
        tier.commit(chunk)
    return outcome


def a_tail(length: int, tokens_from: int = 64, parent: bytes | None = None) -> bytes:
    parent = parent_of(1) if parent is None else parent
    return tail_key(tail_hash(parent, TOKENS[tokens_from:tokens_from + length]), 0, length)


def test_the_tier_knows_which_tail_lengths_follow_a_chunk():
    tier = CPUTier(torch.zeros(8 * PAGE, dtype=torch.uint8))
    put(tier, a_tail(16), PAGE, parent_of(1))
    put(tier, a_tail(48), PAGE, parent_of(1))
    assert tier.tail_lengths(parent_of(1)) == [48, 16]
    assert tier.tail_lengths(parent_of(2)) == []
    assert tier.tail_bytes == 2 * PAGE
    assert tier.clear() == 2
    assert tier.tail_lengths(parent_of(1)) == [] and tier.tail_bytes == 0


def test_tails_are_evicted_before_whole_chunks_and_demoted_tails_first():
    tier = CPUTier(torch.zeros(4 * PAGE, dtype=torch.uint8))
    whole = [rank_key(h, 0) for h in chain_hashes(ROOT, TOKENS, 64, 2)]
    put(tier, a_tail(16), PAGE, parent_of(1))
    put(tier, a_tail(32), PAGE, parent_of(1))
    put(tier, whole[0], PAGE)
    put(tier, whole[1], PAGE)
    # The most recently used tail is demoted: it goes before the older one.
    tier.demote([a_tail(32)])
    assert put(tier, b"new-1".ljust(34, b"\0"), PAGE) is ReserveOutcome.RESERVED
    assert not tier.contains(a_tail(32)) and tier.contains(a_tail(16))
    assert put(tier, b"new-2".ljust(34, b"\0"), PAGE) is ReserveOutcome.RESERVED
    assert not tier.contains(a_tail(16))
    assert tier.contains(whole[0]) and tier.contains(whole[1])
    assert tier.tail_lengths(parent_of(1)) == [] and tier.tail_bytes == 0


def test_a_locked_tail_is_not_evicted():
    tier = CPUTier(torch.zeros(2 * PAGE, dtype=torch.uint8))
    put(tier, a_tail(16), PAGE, parent_of(1))
    put(tier, b"whole".ljust(34, b"\0"), PAGE)
    assert tier.lock_if_present(a_tail(16), 1)
    assert put(tier, b"next".ljust(34, b"\0"), PAGE) is ReserveOutcome.RESERVED
    assert tier.contains(a_tail(16)) and not tier.contains(b"whole".ljust(34, b"\0"))


def test_promotion_brings_up_the_longest_tail_any_tier_holds():
    memory = CPUTier(torch.zeros(8 * PAGE, dtype=torch.uint8))
    candidates = tail_keys(parent_of(1), TOKENS, 64, [48, 32, 16], range(1))
    held = {candidates[1][0]: b"t" * PAGE, candidates[2][0]: b"s" * PAGE}
    disk = DictTier(held)
    lower = LowerTiers(memory, [disk])
    try:
        assert lower.bring_up_first(candidates, 2, parent=parent_of(1)) == 1
        assert memory.lock_count(candidates[1][0]) == 2
        assert not memory.contains(candidates[2][0])
        assert memory.tail_lengths(parent_of(1)) == [32]
        # A candidate no tier holds whole (every rank) is passed over.
        assert lower.bring_up_first([[b"x" * 36]], 1) is None
        # One that loads slower than the engine computes it is too.
        lower.speeds[disk.name].observe_read(PAGE, 10.0)
        assert lower.bring_up_first(candidates[2:], 1, compute_seconds=[0.001]) is None
    finally:
        lower.close()


class QuestionCountingTier(DictTier):
    """Counts the size questions it is asked, of runs and of alternatives alike."""

    def __init__(self, chunks, broken=frozenset()) -> None:
        super().__init__(chunks, broken)
        self.questions: list[int] = []

    def stored_sizes(self, keys):
        self.questions.append(len(keys))
        return [self.stored_size(key) for key in keys]

    def stored_sizes_of_each(self, keys):
        self.questions.append(len(keys))
        return [self.stored_size(key) for key in keys]


def promote_with_tail(held_chunks: int, broken: frozenset = frozenset(),
                      tail_compute_seconds: list[float] | None = None):
    """Two chunks and the tails of 48 and 32 tokens after them offered to a promotion;
    the tier holds `held_chunks` leading chunks and the 32-token tail. With
    `tail_compute_seconds`, the tier reads a page in 10 s."""
    memory = CPUTier(torch.zeros(8 * PAGE, dtype=torch.uint8))
    chunks = [[rank_key(h, 0)] for h in chain_hashes(ROOT, TOKENS, 64, 2)]
    tails = tail_keys(parent_of(2), TOKENS, 128, [48, 32], range(1))
    held = {keys[0]: bytes([i]) * PAGE for i, keys in enumerate(chunks[:held_chunks])}
    held[tails[1][0]] = b"t" * PAGE
    tier = QuestionCountingTier(held, broken)
    lower = LowerTiers(memory, [tier])
    if tail_compute_seconds is not None:
        lower.speeds[tier.name].observe_read(PAGE, 10.0)  # a page takes 10 s to read
    try:
        promoted = lower.bring_up_prefix(chunks, 2, tails=tails,
                                         tail_compute_seconds=tail_compute_seconds)
    finally:
        lower.close()
    return promoted, memory, tier, chunks, tails


def test_a_promotion_reads_the_tail_after_its_chunks_with_them():
    promoted, memory, tier, chunks, tails = promote_with_tail(2)
    assert promoted == (2, 2, 1)
    # One question for the chunks and the tails together, not one more for the tail.
    assert tier.questions == [4]
    assert [memory.lock_count(keys[0]) for keys in [*chunks, tails[1]]] == [2, 2, 2]
    assert memory.tail_lengths(parent_of(2)) == [32]  # stored after the second chunk
    pool = memory.pool.numpy()
    (chunk,) = memory.pin(tails[1])
    assert bytes(pool[chunk.offset:chunk.offset + PAGE]) == b"t" * PAGE
    memory.unpin([chunk])


def test_no_tail_after_a_run_that_ends_early_and_a_failed_tail_keeps_the_run():
    # The second chunk is nowhere: the tail after it is neither read nor locked.
    promoted, memory, _, chunks, tails = promote_with_tail(1)
    assert promoted == (1, 1, None)
    assert memory.lock_count(chunks[0][0]) == 2 and not memory.contains(tails[1][0])
    # The tail's read fails (a bad checksum): the chunks stay, locked; the tail is gone.
    promoted, memory, _, chunks, tails = promote_with_tail(2, broken=frozenset(tails[1]))
    assert promoted == (2, 2, None)
    assert [memory.lock_count(keys[0]) for keys in chunks] == [2, 2]
    assert not memory.contains(tails[1][0])


def test_a_tail_that_loads_slower_than_the_engine_computes_it_is_left():
    promoted, memory, _, chunks, tails = promote_with_tail(
        2, tail_compute_seconds=[0.001, 0.001])
    assert promoted == (2, 2, None)
    assert not memory.contains(tails[1][0])
    # The chunks were read all the same: no engine rate came with them.
    assert [memory.lock_count(keys[0]) for keys in chunks] == [2, 2]
