"""The kvdepot server dies under a serving vLLM engine: requests must not notice."""

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.support.harness import (
    CHUNK,
    DepotServer,
    Engine,
    assert_same_output,
    delta,
    eventually,
    tokens,
)

# Each test may start engines (about a minute each on two cores).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# The connector's test hook: each batch of retrieves waits this long before it
# is submitted, which gives a test time to kill the server between lookup and load.
RETRIEVE_DELAY_S = 4.0


@pytest.fixture(scope="module")
def engine(model_dir: Path, server: DepotServer, log_dir: Path) -> Iterator[Engine]:
    eng = Engine(model_dir, server.url, log_dir / "engine-failure.log",
                 debug__retrieve_delay_s=RETRIEVE_DELAY_S)
    yield eng
    eng.close()


def reference_outputs(engine: Engine, prompts: list[list[int]]) -> list[dict]:
    engine.reset_prefix_cache()
    return engine.generate(prompts, salt="reference")


def test_killed_server_requests_complete_and_restart_brings_hits_back(
    engine: Engine, server: DepotServer
) -> None:
    prompts = [tokens(20 + i, 2 * CHUNK + 50 + i) for i in range(3)]
    references = reference_outputs(engine, prompts)

    server.kill()
    engine.reset_prefix_cache()
    started = time.monotonic()
    outputs = engine.generate(prompts, timeout=120)
    for out, ref in zip(outputs, references, strict=True):
        assert_same_output(out, ref)
    # Again with the client certainly in degraded mode.
    outputs = engine.generate(prompts, timeout=120)
    for out, ref in zip(outputs, references, strict=True):
        assert_same_output(out, ref)
    assert time.monotonic() - started < 90

    server.start()  # same address, empty cache, vLLM untouched
    # The clients notice within a heartbeat or two and register again.
    time.sleep(3)
    before = server.stats()
    engine.generate(prompts[:1])  # vLLM's own cache still has it: stored again from there
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 2
               and delta(s, before, "stored_tails") == 1)
    engine.reset_prefix_cache()
    mid = server.stats()
    out = engine.generate(prompts[:1])[0]
    after = server.stats()
    assert_same_output(out, references[0])
    assert delta(after, mid, "hit_tokens") == 2 * CHUNK + 50  # the chunks and the tail
    assert delta(after, mid, "retrieved_chunks") == 2


def test_failed_retrieve_is_recomputed(engine: Engine, server: DepotServer) -> None:
    prompt = tokens(30, 3 * CHUNK + 10)
    reference = reference_outputs(engine, [prompt])[0]
    engine.reset_prefix_cache()
    before = server.stats()
    engine.generate([prompt])
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 3)

    engine.reset_prefix_cache()
    lookups = server.stats()["lookups"]
    engine.send(op="generate", prompts=[prompt], max_tokens=8, salt=None)
    # The lookup found 3 chunks; the retrieve is held back by the test hook.
    eventually(server, lambda s: s["lookups"] > lookups and s["hit_tokens"] > before["hit_tokens"])
    server.kill()
    out = engine.receive(timeout=120)["outputs"][0]
    assert_same_output(out, reference)
    server.start()
