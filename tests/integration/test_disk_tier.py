"""Lower tiers: write-behind to disk, asynchronous lookups, promotion, restart survival."""


import torch

from kvdepot.client.admin import AdminClient
from kvdepot.rpc.connection import DepotConnection
from tests.support.server import lookup_answered_later, small_server
from tests.support.waiting import wait_for_writes

CHUNK = 64
TOKENS = list(range(900, 900 + 3 * CHUNK + 1))


def test_lookups_reach_the_disk_tier_asynchronously_and_survive_restarts(engines_at,
                                                                         tmp_path):
    disk = ("--disk-path", str(tmp_path / "disk"), "--disk-size", "64MiB")
    server = small_server(chunk_size=CHUNK, extra=disk).start()
    try:
        engine = engines_at(server.url)
        engine.fill(seed=21)
        engine.store("w", TOKENS, list(range(12)), 0, 3 * CHUNK)
        expected = engine.read_blocks(list(range(12)))
        wait_for_writes(server.url, 3)
        with AdminClient(server.url) as admin:
            assert admin.clear() == 3  # CPU memory is empty; the disk still holds all three

        # The LOOKUP reply cannot know the count yet: it is None, and QUERY answers later.
        conn = DepotConnection(server.url)
        assert lookup_answered_later(conn, "raw", TOKENS) == 3
        conn.close()

        engine.write_through_old_view(0.0)
        assert engine.retrieve("raw", TOKENS, list(range(20, 32)), 0, 3 * CHUNK) == set()
        for a, b in zip(expected, engine.read_blocks(list(range(20, 32))), strict=True):
            assert torch.equal(a, b)
    finally:
        server.stop()

    # A new server process on the same directory finds the chunks again.
    server = small_server(chunk_size=CHUNK, extra=disk).start()
    try:
        fresh = engines_at(server.url)
        assert fresh.lookup("after-restart", TOKENS) == 3 * CHUNK
        assert fresh.retrieve("after-restart", TOKENS, list(range(12)), 0, 3 * CHUNK) == set()
        for a, b in zip(expected, fresh.read_blocks(list(range(12))), strict=True):
            assert torch.equal(a, b)
        with AdminClient(server.url) as admin:
            assert admin.stats()["promoted_chunks"] == 3
    finally:
        server.stop()
