"""Two nodes, one Redis cluster (issue 10): a document node A's vLLM engine prefilled is
loaded by a vLLM engine on node B, whose own CPU memory never held it, and B's greedy
tokens are A's. One engine runs at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CHUNK, Engine, assert_same_output, delta, eventually, tokens

from kvdepot.server_process import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


def node(log_dir: Path, name: str, redis_url: str) -> ServerProcess:
    return ServerProcess(chunk_size=CHUNK, l1_size="1GiB", extra=("--remote", redis_url),
                         output=log_dir / f"server-{name}.log").start()


def test_node_b_loads_what_node_a_prefilled(model_dir: Path, log_dir: Path, redis_cluster):
    document = tokens(101, 6 * CHUNK + 50)
    server_a = node(log_dir, "a", redis_cluster.url)
    server_b = node(log_dir, "b", redis_cluster.url)
    try:
        engine_a = Engine(model_dir, server_a.url, log_dir / "engine-node-a.log")
        try:
            before = server_a.stats()
            reference = engine_a.generate([document])[0]  # computed on A: the cold output
            eventually(server_a, lambda s: delta(s, before, "remote_written_chunks") == 6,
                       timeout=60)
        finally:
            engine_a.close()

        engine_b = Engine(model_dir, server_b.url, log_dir / "engine-node-b.log")
        try:
            before = server_b.stats()
            loaded = engine_b.generate([document])[0]
            after = server_b.stats()
        finally:
            engine_b.close()
        assert_same_output(loaded, reference)
        assert delta(after, before, "remote_read_chunks") == 6
        assert delta(after, before, "retrieved_chunks") == 6
        assert after["remote_discarded_chunks"] == 0
    finally:
        server_a.stop()
        server_b.stop()
