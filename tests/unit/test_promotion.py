"""Batched promotion (`LowerTiers.bring_up_run`) over tiers that hold what a dict holds:
the leading run, the locks it leaves, and what a failed read does to the run."""

from __future__ import annotations

import torch

from kvdepot.keys import ChunkKey
from kvdepot.storage.cpu_tier import CPUTier
from kvdepot.storage.load_speed import TierSpeed
from kvdepot.storage.lower_tiers import LowerTiers
from kvdepot.storage.tier import LowerTier

SIZE = 4096


class DictTier(LowerTier):
    """A lower tier in a dict; keys in `broken` fail their read (as a bad checksum does)."""

    def __init__(self, chunks: dict[ChunkKey, bytes], broken: frozenset = frozenset()) -> None:
        self.chunks = chunks
        self.broken = broken
        self.batches: list[int] = []

    def stored_size(self, key):
        data = self.chunks.get(key)
        return None if data is None else len(data)

    def stored_sizes(self, keys):
        self.batches.append(len(keys))
        return super().stored_sizes(keys)

    def read_into(self, key, fingerprint_out, buffer):
        if key in self.broken or key not in self.chunks:
            return False
        buffer[:] = self.chunks[key]
        fingerprint_out[:] = b"fp"
        return True

    def write(self, key, fingerprint, data):
        self.chunks[key] = bytes(data)


def key(i: int) -> ChunkKey:
    return bytes([i]) * 34


def setup(held: list[int], broken: frozenset = frozenset()) -> tuple[CPUTier, LowerTiers,
                                                                       DictTier]:
    memory = CPUTier(torch.zeros(16 * SIZE, dtype=torch.uint8))
    tier = DictTier({key(i): bytes([i]) * SIZE for i in held}, broken)
    return memory, LowerTiers(memory, [tier]), tier


def test_the_leading_run_is_read_up_and_locked_and_nothing_after_a_gap_stays_locked():
    memory, lower, tier = setup([0, 1, 3])
    assert lower.bring_up_run([[key(i)] for i in range(4)], locks=2) == 2
    assert [memory.lock_count(key(i)) for i in range(2)] == [2, 2]
    assert not memory.contains(key(3))  # after the gap: never read
    assert tier.batches == [4]  # one batched question for the whole prefix
    pool = memory.pool.numpy()
    (chunk,) = memory.pin([key(1)])
    assert bytes(pool[chunk.offset:chunk.offset + SIZE]) == bytes([1]) * SIZE
    memory.unpin([chunk])
    lower.close()


def test_chunks_already_in_cpu_memory_are_locked_not_read():
    memory, lower, _ = setup([1])
    _, chunk = memory.reserve(key(0), SIZE, b"fp")
    memory.commit(chunk)
    assert lower.bring_up_run([[key(0)], [key(1)], [key(2)]], locks=1) == 2
    assert memory.lock_count(key(0)) == 1 and memory.lock_count(key(1)) == 1
    lower.close()


def test_a_failed_read_ends_the_run_and_later_chunks_keep_no_locks():
    memory, lower, _ = setup([0, 1, 2], broken=frozenset({key(1)}))
    assert lower.bring_up_run([[key(i)] for i in range(3)], locks=1) == 1
    assert not memory.contains(key(1))
    assert memory.lock_count(key(0)) == 1
    assert memory.contains(key(2)) and memory.lock_count(key(2)) == 0  # read, unlocked
    lower.close()


def test_every_rank_of_a_chunk_must_be_found():
    memory, lower, _ = setup([0, 1, 2])
    keys = [[key(0), key(1)], [key(2), key(3)]]
    assert lower.bring_up_run(keys, locks=1) == 1
    assert memory.lock_count(key(2)) == 0
    lower.close()


def test_a_lookup_whose_engine_computes_faster_than_the_tier_reads_leaves_it_the_chunks():
    memory, lower, tier = setup([0, 1, 2, 3])
    lower.speeds[tier.name].observe_read(SIZE, 1.0)  # SIZE bytes a second: a crawl
    assert lower.bring_up_run([[key(i)] for i in range(4)], locks=1,
                              compute_seconds_per_chunk=0.5) == 0
    assert not any(memory.contains(key(i)) for i in range(4))
    assert lower.skipped_slower[tier.name].value == 4
    # Slower compute: the load pays off, and all of it is read.
    assert lower.bring_up_run([[key(i)] for i in range(4)], locks=1,
                              compute_seconds_per_chunk=2.0) == 4
    assert lower.skipped_slower[tier.name].value == 4


def test_chunks_in_cpu_memory_are_never_skipped_and_cost_no_load_time():
    for in_memory, worth in ((2, 3), (1, 1)):
        memory, lower, tier = setup([0, 1, 2])
        assert lower.bring_up_run([[key(i)] for i in range(in_memory)], locks=0) == in_memory
        lower.speeds[tier.name] = TierSpeed()
        lower.speeds[tier.name].observe_read(SIZE, 1.0)
        # Chunks in CPU memory are free and the others take 1 s each to read: with two
        # free, three chunks load (1 s) before they compute (3 x 0.34 s); with one free,
        # only the free one is worth it.
        assert lower.bring_up_run([[key(i)] for i in range(3)], locks=1,
                                  compute_seconds_per_chunk=0.34) == worth
        assert lower.skipped_slower[tier.name].value == 3 - worth
        assert [memory.contains(key(i)) for i in range(3)] == [i < worth for i in range(3)]
