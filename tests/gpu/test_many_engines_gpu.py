"""Several engine processes and TP ranks on one GPU against one server (issue 14): byte-exact
loads with no cross-talk, a TP group, MLA readers, a rank killed in the middle of a
transfer while the others go on.

The scenarios are the CPU tests' (tests/support/multi_engine.py), run with engines whose
KV cache is on the GPU (CUDA IPC registration, an interprocess event recorded after the
engine's writes for every store and retrieve). Each test gets a server of its own, since
the scenarios read the server's counters; the DMA path ("auto") and the staged kernel
("kernel", shared staging buffers across the engines) both run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.testbed.server_process import ServerProcess
from tests.gpu.support.depot_server import start_server
from tests.support import multi_engine

TP8_RANK = dict(device="cuda", layout="flash_attn", num_layers=8, heads=1, head_dim=128,
                num_blocks=128)
"""One rank of Llama-3.1-70B under TP 8: one KV head of 128 (8 of its 80 layers), in the
FlashAttention layout; 128 blocks hold the scenarios' ranges out and back (up to three
chunks each way at the server's 256-token chunk)."""


@pytest.fixture(params=["auto", "kernel"])
def server(request: pytest.FixtureRequest, tmp_path: Path
           ) -> Iterator[ServerProcess]:
    srv = start_server(request.param, tmp_path / "server.log")
    yield srv
    assert srv.alive(), "the kvdepot server died during the test"
    srv.stop()


def test_eight_engines_on_one_gpu_store_and_load_at_once_without_cross_talk(
        engines, server: ServerProcess) -> None:
    multi_engine.independent_engines(engines, server.url, count=8, **TP8_RANK)


def test_a_tp8_group_hits_only_once_every_rank_stored_and_each_loads_its_shard(
        engines, server: ServerProcess) -> None:
    multi_engine.tp_group(engines, server.url, tp=8, **TP8_RANK)


def test_mla_first_rank_stores_and_eight_tp_ranks_load_under_one_lock(
        engines, server: ServerProcess) -> None:
    multi_engine.mla_readers(engines, server.url, tp=8,
                             **dict(TP8_RANK, layout="mla"))


def test_a_rank_killed_mid_transfer_leaves_the_others_and_the_server_working(
        engines, server: ServerProcess) -> None:
    # Rank 1 stores 512 MiB per operation (32 layers, 8 heads of 128, 256 blocks): the
    # server is inside its copies for many scheduler slices even at the link's speed.
    multi_engine.rank_killed_mid_transfer(
        engines, server, victim=dict(num_layers=32, heads=8, num_blocks=3 * 256),
        blocks_per_op=256, **TP8_RANK)
