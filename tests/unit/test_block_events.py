"""The server's block event log (server/block_event_log.py): what stores bring, what the
tiers report, per tenant, bounded, and never a chunk of another tenant."""

from __future__ import annotations

from kvdepot.keys import rank_key
from kvdepot.metrics import Counter
from kvdepot.protocol import MAX_BLOCK_EVENTS_REPLY
from kvdepot.server import block_event_log
from kvdepot.server.block_event_log import BlockEventLog
from kvdepot.storage.chunk import ChunkScope

WIDTH = 32
BLOCK = 16


def chain(prompt: int, n: int, rank: int = 0) -> list[bytes]:
    return [rank_key(bytes([prompt, i]) * 16, rank) for i in range(n)]


def hashes(prompt: int, chunks: int, per_chunk: int = 4) -> bytes:
    return b"".join(bytes([prompt, i, 7]) + bytes(WIDTH - 3) for i in range(chunks * per_chunk))


def test_a_stored_chunk_is_reported_under_its_block_hashes_with_its_parent():
    log = BlockEventLog()
    keys = chain(1, 2)
    sent = hashes(1, 2)
    log.learn(keys, "t", sent, WIDTH, BLOCK, None)
    for key in keys:
        log.stored("cpu", key, ChunkScope("t"), None)
    reply = log.take("t", -1)
    assert [e.stored for e in reply.events] == [True, True]
    assert b"".join(b for e in reply.events for b in e.block_hashes) == sent
    assert reply.events[0].parent_block_hash is None
    assert reply.events[1].parent_block_hash == reply.events[0].block_hashes[-1]
    assert {e.medium for e in reply.events} == {"CPU"} and reply.events[0].block_size == BLOCK
    assert log.hash_bytes == len(sent)
    assert reply.last == 1 and log.take("t", reply.last).events == []


def test_a_later_store_of_the_next_chunks_links_to_the_earlier_ones():
    log = BlockEventLog()
    keys = chain(1, 3)
    sent = hashes(1, 3)
    log.learn(keys[:1], "t", sent[:4 * WIDTH], WIDTH, BLOCK, None)
    log.learn(keys[1:], "t", sent[4 * WIDTH:], WIDTH, BLOCK, keys[0])
    for key in keys:
        log.stored("cpu", key, ChunkScope("t"), None)
    events = log.take("t", -1).events
    assert events[1].parent_block_hash == events[0].block_hashes[-1]


def test_removals_follow_each_medium_and_the_hashes_go_with_the_last():
    log = BlockEventLog()
    (key,) = chain(1, 1)
    log.learn([key], "t", hashes(1, 1), WIDTH, BLOCK, None)
    log.stored("cpu", key, ChunkScope("t"), None)
    log.stored("disk", key, ChunkScope("t"), None)
    log.stored("cpu", key, ChunkScope("t"), None)  # already there: nothing new
    log.removed("cpu", [(key, "t")])
    assert log.hash_bytes == 4 * WIDTH  # still on disk
    log.removed("disk", [(key, "t")])
    log.removed("disk", [(key, "t")])  # gone already: nothing
    events = log.take("t", -1).events
    assert [(e.stored, e.medium) for e in events] == [
        (True, "CPU"), (True, "DISK"), (False, "CPU"), (False, "DISK")]
    assert all(e.block_hashes == events[0].block_hashes for e in events)
    assert log.hash_bytes == 0


def test_another_tenant_sees_nothing_and_unknown_or_other_rank_chunks_are_not_reported():
    log = BlockEventLog()
    keys = chain(1, 1)
    log.learn(keys, "a", hashes(1, 1), WIDTH, BLOCK, None)
    log.stored("cpu", keys[0], ChunkScope("a"), None)
    other_rank = chain(2, 1, rank=1)
    log.learn(other_rank, "a", hashes(2, 1), WIDTH, BLOCK, None)
    log.stored("cpu", other_rank[0], ChunkScope("a"), None)
    log.stored("cpu", chain(3, 1)[0], ChunkScope("a"), None)  # stored without hashes
    log.stored("shared", keys[0], ChunkScope("a"), None)  # not a reported tier
    assert log.take("b", -1).events == []
    assert len(log.take("a", -1).events) == 1


def test_a_poller_that_fell_behind_is_told_how_many_it_missed(monkeypatch):
    monkeypatch.setattr(block_event_log, "EVENTS_PER_TENANT", 10)
    dropped = Counter()
    log = BlockEventLog(dropped=dropped)
    keys = chain(1, 25)
    log.learn(keys, "t", hashes(1, 25, per_chunk=1), WIDTH, BLOCK, None)
    log.stored("cpu", keys[0], ChunkScope("t"), None)
    first = log.take("t", -1)
    assert first.last == 0
    for key in keys[1:]:
        log.stored("cpu", key, ChunkScope("t"), None)
    late = log.take("t", first.last)
    assert late.dropped == 14 and dropped.value == 14  # events 1..14 are gone
    assert len(late.events) == 10 and late.last == 24
    # A new poller starts at the oldest kept, with nothing counted missing.
    assert log.take("t", -1).dropped == 0


def test_a_place_past_the_end_is_an_earlier_servers_and_starts_again():
    log = BlockEventLog()
    keys = chain(1, 2)
    log.learn(keys, "t", hashes(1, 2), WIDTH, BLOCK, None)
    for key in keys:
        log.stored("cpu", key, ChunkScope("t"), None)
    assert len(log.take("t", 500).events) == 2
    assert log.take("nobody", 500).last == -1


def test_replies_are_bounded_and_hashes_of_stores_that_never_commit_are_forgotten(monkeypatch):
    monkeypatch.setattr(block_event_log, "PENDING_CHUNKS", 100)
    log = BlockEventLog()
    n = MAX_BLOCK_EVENTS_REPLY + 5
    keys = [rank_key(i.to_bytes(32, "little"), 0) for i in range(n)]
    for key in keys:
        log.learn([key], "t", bytes(WIDTH), WIDTH, BLOCK, None)
        log.stored("cpu", key, ChunkScope("t"), None)
    first = log.take("t", -1)
    assert len(first.events) == MAX_BLOCK_EVENTS_REPLY
    assert len(log.take("t", first.last).events) == 5
    never = [rank_key((n + i).to_bytes(32, "little"), 0) for i in range(300)]
    log.learn(never, "t", bytes(WIDTH) * 300, WIDTH, BLOCK, None)
    assert log.hash_bytes == n * WIDTH + 100 * WIDTH
