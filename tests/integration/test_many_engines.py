"""Several engine processes and the ranks of TP groups against one server (CPU engines,
shared memory): byte-exact loads, no cross-talk, MLA readers, a rank killed in the middle
of a transfer. The scenarios are in tests/support/multi_engine.py (the GPU tests run them
too); the bad registrations of a group are here."""

from __future__ import annotations

import pytest
import torch

from kvdepot.client.engine_types import ParallelStrategy
from kvdepot.errors import InvalidRequest
from kvdepot.integrations.vllm.mp_adapter import LMCacheMPWorkerAdapter
from kvdepot.rpc.connection import DepotConnection
from tests.support import multi_engine
from tests.support.raw_registration import register


def test_engines_of_different_models_store_and_load_at_once_without_cross_talk(engines, server):
    multi_engine.independent_engines(engines, server.url, count=4)


def test_a_tp_group_hits_only_once_every_rank_stored_and_each_loads_its_shard(engines, server):
    multi_engine.tp_group(engines, server.url, tp=4)


def test_mla_first_rank_stores_and_every_tp_rank_loads_under_one_lock(engines, server):
    multi_engine.mla_readers(engines, server.url, tp=4, layout="mla")


def test_a_rank_killed_mid_transfer_leaves_the_others_and_the_server_working(engines, server):
    # Rank 1 of the group stores 64 MiB per operation (32 layers of 4 KiB blocks): the
    # server is inside its copies for many scheduler slices.
    multi_engine.rank_killed_mid_transfer(
        engines, server, victim=dict(num_layers=32, num_blocks=3 * 512), blocks_per_op=512)


def _caches(blocks: int = 8) -> dict[str, torch.Tensor]:
    return {"l0": torch.zeros(blocks, 2, 16, 64, dtype=torch.bfloat16)}


def test_a_rank_outside_its_world_size_is_refused(server):
    for world_size, rank in [(4, 4), (1, 1), (2, 7)]:
        conn = DepotConnection(server.url)
        try:
            with pytest.raises(InvalidRequest, match=f"KV rank {rank} is outside world size"):
                register(conn, _caches(), world_size=world_size, rank=rank)
        finally:
            conn.close()
        # The same through the worker adapter an engine uses: the error reaches the engine.
        worker = LMCacheMPWorkerAdapter(
            server.url, None, "bad-rank", vllm_block_size=16,
            parallel_strategy=ParallelStrategy.simple(world_size, rank, world_size))
        try:
            with pytest.raises(InvalidRequest, match="outside world size"):
                worker.register_kv_caches(_caches())
        finally:
            worker.shutdown()
    assert server.stats()["registered_engines"] == 0


def test_one_connection_registering_one_model_under_two_world_sizes_is_refused(server):
    conn = DepotConnection(server.url)
    try:
        register(conn, _caches(), model="m", world_size=2, rank=0)
        with pytest.raises(InvalidRequest, match="world size 2 already"):
            register(conn, _caches(), model="m", world_size=4, rank=1)
        assert server.stats()["registered_engines"] == 1
        # The same world size, and another model under another one, are still taken.
        register(conn, _caches(), model="m", world_size=2, rank=1)
        register(conn, _caches(), model="other", world_size=4, rank=3)
        assert server.stats()["registered_engines"] == 3
    finally:
        conn.close()
