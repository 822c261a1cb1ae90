"""Whole-prompt hits in a real vLLM engine: every chunk loaded, one token computed.

A chunk-aligned prompt hits all its chunks; vLLM loads all but the last token (the last
chunk's blocks vLLM allocated, nothing past them) and computes that one token. When
vLLM's own prefix cache stops one block short of the prompt, kvdepot tops it up (the
engine takes every load here; by default it computes a top-up that arrives later than
its own compute would finish).
Then the edges: one chunk exactly, shorter than a chunk, one token past a chunk, and a
hit whose chunks are gone by the time the load runs (recomputed, output unchanged).
"""

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.client.admin import AdminClient
from kvdepot.testbed.server_process import ServerProcess
from tests.e2e.support.harness import (
    BLOCK,
    CHUNK,
    RETRIEVE_DELAY_S,
    DepotServer,
    Engine,
    assert_same_output,
    cold,
    delta,
    eventually,
    tokens,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(short_lock_server: DepotServer) -> DepotServer:
    """Lookup locks that expire: a test takes a hit's chunks away before its load runs."""
    return short_lock_server


@pytest.fixture(scope="module")
def engine(model_dir: Path, server: ServerProcess, log_dir: Path) -> Iterator[Engine]:
    eng = Engine(model_dir, server.url, log_dir / "engine-full-hits.log",
                 llm_kwargs={"disable_log_stats": False},
                 debug__retrieve_delay_s=RETRIEVE_DELAY_S,
                 # Every load is taken: the delayed retrieves would otherwise time loads
                 # slower than computing a top-up (test_connector_logic covers that choice).
                 skip_slow_loads=False)
    yield eng
    eng.close()


def by_source(engine: Engine) -> dict[str, float]:
    metrics = engine.metrics()
    return {source: metrics.get(f"vllm:prompt_tokens_by_source[{source}]", 0.0)
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def store(engine: Engine, server: ServerProcess, prompt: list[int], chunks: int) -> None:
    engine.reset_prefix_cache()
    before = server.stats()
    engine.generate([prompt])
    eventually(server, lambda s: delta(s, before, "stored_chunks") == chunks)


def counted(engine: Engine, before: dict[str, float], tokens_total: int) -> dict[str, int]:
    """vLLM's prompt tokens by source since `before`, once the request is counted."""
    deadline = time.monotonic() + 30
    while True:
        now = by_source(engine)
        got = {k: int(now[k] - before[k]) for k in now}
        if sum(got.values()) >= tokens_total or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_chunk_aligned_prompt_loads_every_chunk_and_computes_one_token(
    engine: Engine, server: ServerProcess
) -> None:
    prompt = tokens(40, 4 * CHUNK)
    reference = cold(engine, prompt)
    store(engine, server, prompt, 4)

    engine.reset_prefix_cache()  # only kvdepot can serve it now
    before, vllm_before = server.stats(), by_source(engine)
    out = engine.generate([prompt])[0]
    after = server.stats()
    assert_same_output(out, reference)
    assert delta(after, before, "hit_tokens") == 4 * CHUNK
    assert delta(after, before, "retrieved_chunks") == 4
    assert counted(engine, vllm_before, len(prompt)) == {
        "local_compute": 1, "local_cache_hit": 0, "external_kv_transfer": 4 * CHUNK - 1}

    # vLLM's own cache now holds the prompt, which it serves up to its last block
    # (it recomputes that block); kvdepot tops the block up from the last chunk.
    before, vllm_before = server.stats(), by_source(engine)
    again = engine.generate([prompt])[0]
    after = server.stats()
    assert_same_output(again, reference)
    assert delta(after, before, "retrieved_chunks") == 1
    assert counted(engine, vllm_before, len(prompt)) == {
        "local_compute": 1, "local_cache_hit": 4 * CHUNK - BLOCK,
        "external_kv_transfer": BLOCK - 1}
    assert after["locked_chunks"] == 0


def test_prompt_of_exactly_one_chunk(engine: Engine, server: ServerProcess) -> None:
    prompt = tokens(41, CHUNK)
    reference = cold(engine, prompt)
    store(engine, server, prompt, 1)
    engine.reset_prefix_cache()
    before, vllm_before = server.stats(), by_source(engine)
    out = engine.generate([prompt])[0]
    assert_same_output(out, reference)
    assert delta(server.stats(), before, "retrieved_chunks") == 1
    assert counted(engine, vllm_before, len(prompt))["local_compute"] == 1


def test_prompt_shorter_than_a_chunk_is_kept_as_a_tail(engine: Engine, server: ServerProcess
                                                       ) -> None:
    prompt = tokens(42, CHUNK - 1)
    reference = cold(engine, prompt)
    engine.reset_prefix_cache()
    before = server.stats()
    out = engine.generate([prompt])[0]
    mid = eventually(server, lambda s: delta(s, before, "stored_tails") == 1)
    assert_same_output(out, reference)
    assert delta(mid, before, "stored_chunks") == 0
    engine.reset_prefix_cache()
    again = engine.generate([prompt])[0]
    assert_same_output(again, reference)
    after = server.stats()
    assert delta(after, mid, "hit_tokens") == CHUNK - 1
    assert delta(after, mid, "retrieved_tails") == 1


def test_prompt_shorter_than_a_tail_never_reaches_the_server(engine: Engine,
                                                              server: ServerProcess) -> None:
    prompt = tokens(45, 15)  # client.scheduler.MIN_TAIL_TOKENS is 16
    reference = cold(engine, prompt)
    engine.reset_prefix_cache()
    before = server.stats()
    out = engine.generate([prompt])[0]
    time.sleep(1)  # a store, were one sent, would have landed by now
    after = server.stats()
    assert_same_output(out, reference)
    assert delta(after, before, "lookups") == 0
    assert delta(after, before, "stores") == 0


def test_prompt_one_token_past_a_chunk_boundary(engine: Engine, server: ServerProcess) -> None:
    prompt = tokens(43, 2 * CHUNK + 1)
    reference = cold(engine, prompt)
    store(engine, server, prompt, 2)
    engine.reset_prefix_cache()
    before, vllm_before = server.stats(), by_source(engine)
    out = engine.generate([prompt])[0]
    assert_same_output(out, reference)
    assert delta(server.stats(), before, "retrieved_chunks") == 2
    assert counted(engine, vllm_before, len(prompt)) == {
        "local_compute": 1, "local_cache_hit": 0, "external_kv_transfer": 2 * CHUNK}


def test_hit_chunks_gone_by_load_time_are_recomputed(
    engine: Engine, server: ServerProcess
) -> None:
    prompt = tokens(44, 3 * CHUNK)
    reference = cold(engine, prompt)
    store(engine, server, prompt, 3)
    engine.reset_prefix_cache()
    before = server.stats()
    engine.send(op="generate", prompts=[prompt], max_tokens=8, salt=None)
    # The lookup locked 3 chunks; the load waits for the test hook meanwhile. The
    # locks expire (TTL) and the chunks are dropped before it runs.
    eventually(server, lambda s: delta(s, before, "hit_tokens") == 3 * CHUNK)
    eventually(server, lambda s: delta(s, before, "expired_lookups") >= 1, timeout=10)
    with AdminClient(server.url) as admin:
        assert admin.clear() >= 3
    out = engine.receive(timeout=120)["outputs"][0]
    after = server.stats()
    assert_same_output(out, reference)
    assert delta(after, before, "retrieve_errors") == 1
    assert delta(after, before, "retrieved_chunks") == 0
    # Recomputed, and stored again, since the server lost them.
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 3)
