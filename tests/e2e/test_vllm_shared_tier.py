"""Two nodes, one shared Redis (issues 10 and 23). A document node A's vLLM engine
prefilled is loaded by node B's engine, whose own CPU memory never held it, and B's greedy
tokens are A's. Node B reaches Redis through a proxy that can throttle it: over a slow
link B's server leaves to its engine every chunk that would load slower than the engine
computes it (and B's answers are still A's); once the link is fast again, which B's own
write-behind measures, B loads again. The TTFT figures are `kvdepot bench remote --ttft
--link-mbps` (docs/shared-tier.md)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvdepot.client.admin_api import AdminAPI
from kvdepot.client.scheduler import MIN_TAIL_TOKENS
from kvdepot.testbed.redis_processes import RedisProcess, redis_server_binary
from kvdepot.testbed.server_process import ServerProcess, free_port
from kvdepot.testbed.throttled_link import ThrottledLink
from tests.e2e.support.harness import (
    CHUNK,
    Engine,
    assert_same_output,
    close_engines,
    delta,
    eventually,
    tokens,
)
from tests.support.server import ForkedServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

SLOW_LINK = 2e6
"""Bytes per second: a chunk of the test model (256 tokens, 512 KiB) takes a quarter
second over it, where the engine computes it in about 13 ms (17,000-20,000 tokens/s)."""

TAIL = 200
"""Tokens past the last whole chunk of the prompts B must load whole. A tail of 40-50
tokens computes in 2-2.5 ms, and its 128-token block loads in about 1.5 ms over loopback:
whether it pays off is then within the error of either estimate (once, in a loaded run, B
computed such a tail and read only the chunks). 200 tokens compute in about 10 ms, and
load in about 2.5: as clear a win as a chunk."""


@dataclass
class Nodes:
    server_a: ServerProcess
    server_b: ServerProcess
    engine_a: Engine
    engine_b: Engine
    link: ThrottledLink
    admin_b: AdminAPI

    def remote_tier_of_b(self) -> dict:
        (remote,) = [t for t in self.admin_b.status()["tiers"] if t["name"] == "shared"]
        return remote


def node(log_dir: Path, name: str, redis_url: str, admin_port: int) -> ServerProcess:
    return ForkedServerProcess(chunk_size=CHUNK, l1_size="1GiB",
                         extra=("--remote", redis_url, "--admin-port", str(admin_port)),
                         output=log_dir / f"server-{name}.log").start()


@pytest.fixture(scope="module")
def nodes(model_dir: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Nodes]:
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (scripts/bootstrap installs it as root)")
    redis = RedisProcess(tmp_path_factory.mktemp("redis"), maxmemory="1gb").start()
    link = ThrottledLink(("127.0.0.1", redis.port))
    admin_b = free_port()
    server_a = node(log_dir, "a", f"redis://{redis.address}", free_port())
    server_b = node(log_dir, "b", f"redis://{link.address}", admin_b)
    engines: list[Engine] = []
    try:
        engines.append(Engine(model_dir, server_a.url, log_dir / "engine-node-a.log",
                              wait=False))
        engines.append(Engine(model_dir, server_b.url, log_dir / "engine-node-b.log",
                              wait=False))
        for engine in engines:
            engine.wait_ready()
        yield Nodes(server_a, server_b, engines[0], engines[1], link,
                    AdminAPI(f"http://127.0.0.1:{admin_b}", url=server_b.url))
    finally:
        close_engines(*engines)
        server_a.stop()
        server_b.stop()
        link.close()
        redis.stop()


def prefill_on_a(nodes: Nodes, prompts: list[list[int]]) -> list[dict]:
    before = nodes.server_a.stats()
    outputs = [nodes.engine_a.generate([prompt])[0] for prompt in prompts]
    # Every whole chunk, and the tail of each prompt that has one.
    pieces = sum(len(p) // CHUNK + (len(p) % CHUNK >= MIN_TAIL_TOKENS) for p in prompts)
    eventually(nodes.server_a,
               lambda s: delta(s, before, "remote_written_chunks") == pieces, timeout=60)
    return outputs


def write_behind_on_b(nodes: Nodes, prompts: list[list[int]]) -> None:
    """B's engine computes prompts of its own: each step measures its prefill rate, and
    each prompt's write-behind (one batch each) measures B's link."""
    for prompt in prompts:
        wanted = nodes.server_b.stats()["remote_written_chunks"] + (len(prompt) - 1) // CHUNK
        nodes.engine_b.generate([prompt])
        eventually(nodes.server_b, lambda s, w=wanted: s["remote_written_chunks"] >= w,
                   timeout=60)


def test_node_b_loads_what_node_a_prefilled(nodes: Nodes):
    document = tokens(101, 6 * CHUNK + TAIL)
    (reference,) = prefill_on_a(nodes, [document])  # computed on A: the cold output
    before = nodes.server_b.stats()
    loaded = nodes.engine_b.generate([document])[0]
    after = nodes.server_b.stats()
    assert_same_output(loaded, reference)
    assert delta(after, before, "remote_read_chunks") == 7  # 6 chunks and the tail
    assert delta(after, before, "retrieved_chunks") == 6
    assert delta(after, before, "retrieved_tails") == 1
    assert after["remote_discarded_chunks"] == 0


def test_a_slow_link_is_computed_past_and_a_fast_one_loaded(nodes: Nodes):
    slow = [tokens(300 + chunks, chunks * CHUNK + 40) for chunks in (1, 2, 6)]
    later = tokens(400, 6 * CHUNK + TAIL)
    *references, reference_later = prefill_on_a(nodes, [*slow, later])

    nodes.link.bytes_per_s = SLOW_LINK
    write_behind_on_b(nodes, [tokens(seed, 4 * CHUNK + 10) for seed in (500, 501)])
    assert 0 < nodes.remote_tier_of_b()["read_bytes_per_s"] < 2 * SLOW_LINK
    before = nodes.server_b.stats()
    for prompt, reference in zip(slow, references, strict=True):
        assert_same_output(nodes.engine_b.generate([prompt])[0], reference)
    after = nodes.server_b.stats()
    assert delta(after, before, "remote_read_chunks") == 0
    assert delta(after, before, "remote_skipped_slower_chunks") == 9
    assert delta(after, before, "retrieved_chunks") == 0

    nodes.link.bytes_per_s = None
    write_behind_on_b(nodes, [tokens(600 + seed, CHUNK + 10) for seed in range(8)])
    before = nodes.server_b.stats()
    assert_same_output(nodes.engine_b.generate([later])[0], reference_later)
    after = nodes.server_b.stats()
    read = delta(after, before, "remote_read_chunks")
    skipped = delta(after, before, "remote_skipped_slower_chunks")
    # The 6 chunks are read over the fast link. The tail is a read of its own, its round
    # trip not shared: under a loaded machine's round trips B once judged it slower than
    # computing its 200 tokens (make test, 2026-12-06), which the estimates allow; it is
    # then counted as passed over, never dropped unaccounted.
    assert read >= 6 and read + skipped == 7, (read, skipped)
