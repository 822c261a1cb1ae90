"""The KV event publisher never makes a tier wait: past its bound, notices are dropped,
counted, and the next batch says how many."""

from __future__ import annotations

from kvdepot.client.kv_event_subscriber import ChunkIndex, KVEventSubscriber
from kvdepot.kv_event_wire import ChunkRemoved, ChunkStored
from kvdepot.metrics import Counter
from kvdepot.server import kv_event_publisher
from kvdepot.server.kv_event_publisher import KVEventPublisher
from kvdepot.storage.chunk import ChunkScope
from kvdepot.testbed.server_process import free_port


def key(i: int, rank: int = 0) -> bytes:
    return i.to_bytes(32, "big") + rank.to_bytes(2, "little")


def test_past_its_bound_notices_are_dropped_and_counted(monkeypatch):
    monkeypatch.setattr(kv_event_publisher, "MAX_PENDING", 5)
    url, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    dropped = Counter()
    publisher = KVEventPublisher(url, replay, 64, dropped=dropped)
    scope = ChunkScope("t", "m")
    publisher.cleared("")  # what start() publishes first, before its thread runs
    parent = None
    for i in range(3):  # one prompt's chunks: one event
        publisher.stored("cpu", key(i), scope, parent)
        parent = key(i)[:32]
    publisher.removed("cpu", [(key(0), "t"), (key(1, rank=1), "t")])  # 6 of 5: dropped
    publisher.removed("cpu", [(key(0), "t")])
    assert dropped.value == 2
    publisher._thread.start()
    subscriber = KVEventSubscriber(url, replay)
    try:
        batches = []
        while not batches:
            batches = subscriber.replay(0)
        ((sequence, batch),) = batches
        assert sequence == 0 and batch.dropped == 2
        stored, removed = batch.events[1:]
        assert stored == ChunkStored([key(i)[:32] for i in range(3)], None, 64, "cpu", 0,
                                     "t", "m")
        assert removed == ChunkRemoved([key(0)[:32]], "cpu", 0, "t")
        index = ChunkIndex()
        index.apply(sequence, batch)
        assert index.gaps == 1  # it knows it cannot trust itself
        assert index.tiers["cpu"] == {("t", 0, key(i)[:32]) for i in (1, 2)}
    finally:
        subscriber.close()
        publisher.close()
