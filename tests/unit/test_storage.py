import pytest
import torch

from kvdepot.errors import ChunkMissing
from kvdepot.storage.chunk import Chunk
from kvdepot.storage.cpu_tier import CPUTier, ReserveOutcome
from kvdepot.storage.extent_allocator import ExtentAllocator


def test_allocator_first_fit_and_coalescing():
    a = ExtentAllocator(16 * 4096)
    offs = [a.allocate(4096) for _ in range(16)]
    assert offs == [i * 4096 for i in range(16)]
    assert a.allocate(1) is None
    for o in offs[4:8]:
        a.free(o, 4096)
    assert a.largest_free == 4 * 4096
    assert a.allocate(4 * 4096) == 4 * 4096
    for o in offs:
        if not 4 <= o // 4096 < 8:
            a.free(o, 4096)
    a.free(4 * 4096, 4 * 4096)
    assert a.largest_free == 16 * 4096 and a.allocated_bytes == 0


def tier(nchunks: int, chunk: int = 4096) -> CPUTier:
    return CPUTier(torch.zeros(nchunks * chunk, dtype=torch.uint8))


def view(t: CPUTier, chunk: Chunk) -> torch.Tensor:
    return t.pool[chunk.offset:chunk.offset + chunk.nbytes]


def put(t: CPUTier, key: bytes, nbytes: int = 4096) -> ReserveOutcome:
    outcome, chunk = t.reserve(key, nbytes, b"fp")
    if chunk is not None:
        t.commit(chunk)
    return outcome


def test_writing_chunks_are_invisible_until_committed():
    t = tier(2)
    outcome, chunk = t.reserve(b"k", 4096, b"fp")
    assert outcome is ReserveOutcome.RESERVED
    assert not t.contains(b"k")
    assert t.reserve(b"k", 4096, b"fp")[0] is ReserveOutcome.PRESENT
    with pytest.raises(ChunkMissing) as missing:
        t.pin([b"k"])
    assert missing.value.index == 0
    t.commit(chunk)
    assert t.contains(b"k")


def test_pin_pins_every_chunk_or_none():
    t = tier(2)
    put(t, b"a")
    with pytest.raises(ChunkMissing) as missing:
        t.pin([b"a", b"gone"])
    assert missing.value.index == 1
    assert t.clear() == 1  # "a" was left unpinned, so it can be dropped


def test_lru_eviction_skips_locked_and_pinned_chunks():
    t = tier(3)
    for k in (b"a", b"b", b"c"):
        put(t, k)
    t.lock_prefix([[b"a"]], 1)
    pinned = t.pin([b"b"])
    assert put(t, b"d") is ReserveOutcome.RESERVED
    assert t.contains(b"a") and t.contains(b"b") and not t.contains(b"c")
    assert put(t, b"e") is ReserveOutcome.RESERVED  # evicts d, the only evictable one
    assert not t.contains(b"d")
    t.unpin(pinned)
    assert t.evictions.value == 2


def test_full_when_everything_is_locked_and_nothing_is_corrupted():
    t = tier(2)
    put(t, b"a")
    put(t, b"b")
    filled = t.pin([b"a"])
    view(t, filled[0]).fill_(7)
    t.unpin(filled)
    t.lock_prefix([[b"a"], [b"b"]], 1)
    assert put(t, b"c") is ReserveOutcome.FULL
    assert t.contains(b"a") and t.contains(b"b") and not t.contains(b"c")
    (a,) = t.pin([b"a"])
    assert bool((view(t, a) == 7).all())
    t.unpin([a])
    t.unlock({b"a": 1})
    assert put(t, b"c") is ReserveOutcome.RESERVED
    assert not t.contains(b"a")


def test_an_uncommitted_chunk_is_never_evicted():
    t = tier(1)
    _, writing = t.reserve(b"w", 4096, b"fp")
    assert put(t, b"x") is ReserveOutcome.FULL
    t.abort(writing)
    assert put(t, b"x") is ReserveOutcome.RESERVED


def test_clear_keeps_locked_chunks():
    t = tier(3)
    for k in (b"a", b"b", b"c"):
        put(t, k)
    t.lock_prefix([[b"b"]], 2)
    assert t.clear() == 2
    assert t.contains(b"b") and len(t) == 1


def test_an_unpinned_pool_is_page_aligned_and_writable():
    from kvdepot.transfer.host_pool import allocate_pool

    pool = allocate_pool(1 << 20)
    assert pool.data_ptr() % 4096 == 0 and pool.numel() == 1 << 20
    pool[123] = 7
    assert int(pool[123]) == 7


def test_lock_prefix_locks_the_leading_run_and_reads_no_further():
    tier = CPUTier(torch.empty(1 << 16, dtype=torch.uint8))
    for key in (b"a0", b"a1", b"b1", b"c0"):
        _, chunk = tier.reserve(key, 4096, b"")
        tier.commit(chunk)
    taken = []

    def chunks():
        for keys in ([b"a0", b"a1"], [b"b0", b"b1"], [b"c0"]):
            taken.append(keys)
            yield keys

    hit, missing = tier.lock_prefix(chunks(), 3)
    assert hit == [[b"a0", b"a1"]] and missing == [b"b0", b"b1"]
    assert len(taken) == 2, "the chunk after the first miss was hashed"
    # Only the run is locked: b1 is present but its chunk is not whole.
    assert [tier.lock_count(k) for k in (b"a0", b"a1", b"b1", b"c0")] == [3, 3, 0, 0]
    assert tier.lock_prefix(iter([[b"a0"], [b"b1"]]), 1) == ([[b"a0"], [b"b1"]], None)
    assert [tier.lock_count(k) for k in (b"a0", b"b1")] == [4, 1]
