"""Issue 26, item 2: the server keeps the vLLM block hashes a store sends and reports, to
every engine of the tenant, the chunks entering and leaving its tiers under them
(TAKE_BLOCK_EVENTS); engines of another tenant hear nothing; bad hashes are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdepot.client.admin import AdminClient
from kvdepot.errors import InvalidRequest
from kvdepot.protocol import RequestType, Store, TakeBlockEvents, pack_ints
from kvdepot.rpc.connection import DepotConnection
from tests.support.credentials import credential_file
from tests.support.engine import EngineProcess
from tests.support.raw_registration import FENCE, register
from tests.support.server import running_server, small_server
from tests.support.waiting import wait_until

CHUNK = 64
BLOCK = 16
BLOCKS_PER_CHUNK = CHUNK // BLOCK


def prompt(seed: int, chunks: int) -> list[int]:
    return list(range(seed * 100_000, seed * 100_000 + chunks * CHUNK + 1))


def block_hashes(seed: int, blocks: int) -> list[bytes]:
    """Stand-ins for vLLM's sha256 block hashes: 32 distinct bytes per block."""
    return [bytes([seed % 256, i % 256, i // 256]) + bytes(29) for i in range(blocks)]


def test_every_engine_of_the_tenant_hears_of_stores_evictions_and_clears_by_hash(
        state_dir, tmp_path):
    credentials = {t: credential_file(state_dir, t, "engine", t) for t in ("alpha", "beta")}
    # Chunks are 32 KiB: CPU memory holds 64 of them, the disk tier about 30.
    server = small_server(chunk_size=CHUNK, l1_size="2MiB",
                          extra=("--disk-path", str(tmp_path / "disk"), "--disk-size", "1MiB"))
    server.start()
    storer = EngineProcess(server.url, credentials=credentials["alpha"], num_blocks=64)
    reader = EngineProcess(server.url, credentials=credentials["alpha"], num_blocks=64)
    stranger = EngineProcess(server.url, credentials=credentials["beta"], num_blocks=64)
    try:
        storer.fill(seed=1)
        hashes = block_hashes(1, 4 * BLOCKS_PER_CHUNK)
        storer.store("first", prompt(1, 4), list(range(16)), 0, 4 * CHUNK,
                     block_hashes=b"".join(hashes))
        # Stored without hashes: kept and served as ever, never reported.
        storer.store("plain", prompt(2, 2), list(range(8)), 0, 2 * CHUNK)

        for engine in (storer, reader):
            events = engine.block_events(count=8)  # 4 chunks, in CPU memory and on disk
            stored = [e for e in events if e[1] == "CPU"]
            assert [e[0] for e in stored] == [True] * 4
            assert [h for e in stored for h in e[2]] == hashes
            assert [e[3] for e in stored] == [None, *(e[2][-1] for e in stored[:-1])]
            assert {e[4] for e in events} == {BLOCK}
            assert sorted(h for e in events if e[1] == "DISK" for h in e[2]) == sorted(hashes)
        assert stranger.block_events(count=1, wait=2) == []
        assert server.stats()["block_hash_bytes"] == len(hashes) * 32

        # The operator clears CPU memory: the chunks leave it and stay on disk.
        with AdminClient(server.url) as admin:
            admin.clear()
        cleared = reader.block_events(count=4)
        assert [(e[0], e[1]) for e in cleared] == [(False, "CPU")] * 4
        assert sorted(h for e in cleared for h in e[2]) == sorted(hashes)
        assert server.stats()["block_hash_bytes"] == len(hashes) * 32

        # Other prompts fill the disk tier: its oldest files go, and with them the hashes.
        for seed in range(3, 15):
            storer.store(f"fill{seed}", prompt(seed, 4), list(range(16)), 0, 4 * CHUNK)
        evicted = reader.block_events(count=4)
        assert [(e[0], e[1]) for e in evicted] == [(False, "DISK")] * 4
        assert sorted(h for e in evicted for h in e[2]) == sorted(hashes)
        wait_until(lambda: server.stats()["block_hash_bytes"] == 0, timeout=10)
    finally:
        for engine in (storer, reader, stranger):
            engine.close()
        server.stop()


@pytest.mark.parametrize(("hashes", "size", "why"), [
    (bytes(32 * 16 - 1), BLOCK, "are not 16 hashes"),  # a byte short
    (bytes(33 * 16), BLOCK, "are not 16 hashes"),  # longer than a sha256
    (bytes(32 * 16), 48, "does not divide the chunk size"),
    (bytes(32 * 16), 0, "does not divide the chunk size"),
])
def test_hashes_that_do_not_fit_the_blocks_are_refused_and_nothing_is_stored(hashes, size, why):
    with running_server(chunk_size=CHUNK) as server:
        conn = DepotConnection(server.url)
        try:
            kv = torch.ones(64, 2, BLOCK, 16)
            instance_id = register(conn, {"l0": kv})
            slot, generation = FENCE.begin()
            request = Store(instance_id=instance_id, request_id="bad",
                            token_ids=pack_ints(prompt(1, 4)), start=0, end=4 * CHUNK,
                            block_ids=pack_ints(np.arange(16)), fence_slot=slot,
                            fence_generation=generation, block_hashes=hashes,
                            hash_block_size=size)
            with pytest.raises(InvalidRequest, match=why):
                conn.submit(RequestType.STORE, request).result(30)
            FENCE.release(slot)
            assert server.stats()["chunks"] == 0
            reply = conn.call(RequestType.TAKE_BLOCK_EVENTS, TakeBlockEvents(-1), timeout=30)
            assert reply.events == [] and reply.last == -1
        finally:
            conn.close()


def test_a_shared_tier_hit_is_reported_by_the_node_that_loads_it(shared_redis_cluster,
                                                                 engines_at):
    """Node A stores with hashes; node B's lookup brings the chunks up from the cluster and
    B's engines hear of them under the hashes B's lookup sent."""
    remote = ("--remote", shared_redis_cluster.url, "--remote-piece-size", "8KiB")
    with running_server(chunk_size=CHUNK, extra=remote) as node_a, \
            running_server(chunk_size=CHUNK, extra=remote) as node_b:
        a = engines_at(node_a.url, num_blocks=64)
        b = engines_at(node_b.url, num_blocks=64)
        a.fill(seed=1)
        tokens = prompt(1, 3)
        hashes = block_hashes(1, 3 * BLOCKS_PER_CHUNK)
        a.store("s", tokens, list(range(12)), 0, 3 * CHUNK, block_hashes=b"".join(hashes))
        wait_until(lambda: node_a.stats()["remote_written_chunks"] >= 3, timeout=30)
        # Looked up without hashes: loaded, never reported.
        assert b.lookup("plain", tokens) == 3 * CHUNK
        b.call("scheduler", "end_session", "plain")
        assert b.block_events(count=1, wait=1) == []
        with AdminClient(node_b.url) as admin:
            admin.clear()
        assert b.lookup("hashed", tokens, block_hashes=hashes) == 3 * CHUNK
        b.call("scheduler", "end_session", "hashed")
        events = b.block_events(count=3)
        assert [(e[0], e[1]) for e in events] == [(True, "CPU")] * 3
        assert [h for e in events for h in e[2]] == hashes
        assert [e[3] for e in events] == [None, *(e[2][-1] for e in events[:-1])]
        # An engine that believes the first chunk held sends the hashes of the rest only
        # (and the one before them): the rest is reported, linked to the first.
        with AdminClient(node_b.url) as admin:
            admin.clear()
        assert len(b.block_events(count=3)) == 3  # the removals
        assert b.lookup("hinted", tokens, block_hashes=hashes,
                        held_blocks=BLOCKS_PER_CHUNK) == 3 * CHUNK
        b.call("scheduler", "end_session", "hinted")  # its locks would keep them from a clear
        events = b.block_events(count=2)
        assert [(e[0], e[1]) for e in events] == [(True, "CPU")] * 2
        assert [h for e in events for h in e[2]] == hashes[BLOCKS_PER_CHUNK:]
        assert [e[3] for e in events] == [hashes[BLOCKS_PER_CHUNK - 1], events[0][2][-1]]
        # CPU memory holds the first chunk (brought up without hashes); a lookup sending
        # every hash has the rest reported, the first chunk's hashes skipped.
        with AdminClient(node_b.url) as admin:
            admin.clear()
        assert len(b.block_events(count=2)) == 2  # the removals
        assert b.lookup("first", tokens[:CHUNK + 1]) == CHUNK
        b.call("scheduler", "end_session", "first")
        assert b.lookup("rest", tokens, block_hashes=hashes) == 3 * CHUNK
        events = b.block_events(count=2)
        assert [h for e in events for h in e[2]] == hashes[BLOCKS_PER_CHUNK:]
        assert events[0][3] == hashes[BLOCKS_PER_CHUNK - 1]


def test_a_server_that_restarts_is_reported_as_having_lost_every_block(state_dir):
    server = small_server(chunk_size=CHUNK)
    server.start()
    engine = EngineProcess(server.url, num_blocks=64, heartbeat_interval=0.2)
    try:
        engine.fill(seed=1)
        hashes = block_hashes(1, 2 * BLOCKS_PER_CHUNK)
        engine.store("s", prompt(1, 2), list(range(8)), 0, 2 * CHUNK,
                     block_hashes=b"".join(hashes))
        assert len(engine.block_events(count=2)) == 2
        server.kill()  # CPU memory is gone with it
        server.start()
        (lost,) = engine.block_events(count=1)
        assert (lost[0], lost[1], sorted(lost[2])) == (False, "CPU", sorted(hashes))
    finally:
        engine.close()
        server.stop()
