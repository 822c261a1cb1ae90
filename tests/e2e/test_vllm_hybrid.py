"""A hybrid model (sliding-window and full attention layers) in a real vLLM engine.

vLLM's hybrid KV cache manager gives it two KV cache groups; a sliding window lets the
blocks before it go while the request runs. The chunks must carry both groups, a load
must write only the blocks vLLM holds, and the greedy output after a hit must be the
cold run's.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.client.admin import AdminClient
from kvdepot.testbed.checkpoint import seeded_checkpoint
from kvdepot.testbed.server_process import ServerProcess
from tests.e2e.support.harness import (
    BLOCK,
    CHUNK,
    MODEL_CONFIG,
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

WINDOW = 2 * BLOCK
# The small Llama with its first layer attending to a sliding window only (vLLM's Llama
# reads `layer_types`, as Gemma 3's and gpt-oss's configs have them).
HYBRID_CONFIG = {**MODEL_CONFIG, "layer_types": ["sliding_attention", "full_attention"],
                 "sliding_window": WINDOW}


@pytest.fixture(scope="module")
def server(short_lock_server: DepotServer) -> DepotServer:
    """Lookup locks that expire: a test takes a hit's chunks away before its load runs."""
    return short_lock_server


@pytest.fixture(scope="module")
def engine(server: ServerProcess, log_dir: Path) -> Iterator[Engine]:
    eng = Engine(seeded_checkpoint(HYBRID_CONFIG), server.url, log_dir / "engine-hybrid.log",
                 llm_kwargs={"disable_hybrid_kv_cache_manager": False},
                 debug__retrieve_delay_s=RETRIEVE_DELAY_S)
    yield eng
    eng.close()


def test_engine_registered_two_kv_cache_groups(engine: Engine, server: ServerProcess) -> None:
    assert isinstance(server.output, Path)
    assert "in 2 KV cache group(s)" in server.output.read_text()


def test_the_window_matters(engine: Engine) -> None:
    # Tokens long before the window still reach the output through the full layer,
    # and those inside it through both: changing either changes the output.
    base = tokens(50, 3 * CHUNK + 10)
    early = [base[0] + 1, *base[1:]]
    late = [*base[:-5], base[-5] + 1, *base[-4:]]
    a, b, c = cold(engine, base), cold(engine, early), cold(engine, late)
    assert a["logprobs"] != pytest.approx(b["logprobs"], abs=1e-3)
    assert a["logprobs"] != pytest.approx(c["logprobs"], abs=1e-3)


@pytest.mark.parametrize("length", [4 * CHUNK + 70, 4 * CHUNK])
def test_hit_gives_the_cold_output(engine: Engine, server: ServerProcess, length: int) -> None:
    prompt = tokens(51 + length, length)
    reference = cold(engine, prompt)
    engine.reset_prefix_cache()
    before = server.stats()
    first = engine.generate([prompt])[0]
    mid = eventually(server, lambda s: delta(s, before, "stored_chunks") == 4)
    assert_same_output(first, reference)

    engine.reset_prefix_cache()  # only kvdepot can serve it now
    second = engine.generate([prompt])[0]
    after = server.stats()
    assert_same_output(second, reference)
    assert delta(after, mid, "retrieved_chunks") == 4
    assert delta(after, mid, "retrieve_errors") == 0

    # From vLLM's own cache (its window blocks kept), topped up where it stops short.
    third = engine.generate([prompt])[0]
    assert_same_output(third, reference)
    assert delta(server.stats(), after, "retrieve_errors") == 0


def test_prefix_of_a_stored_document_hits_in_a_new_request(
    engine: Engine, server: ServerProcess
) -> None:
    document = tokens(60, 4 * CHUNK + 10)
    engine.reset_prefix_cache()
    before = server.stats()
    engine.generate([document])
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 4)
    question = document[: 3 * CHUNK + 30] + tokens(61, 90)
    reference = cold(engine, question)
    engine.reset_prefix_cache()
    before = server.stats()
    out = engine.generate([question])[0]
    after = server.stats()
    assert_same_output(out, reference)
    assert delta(after, before, "retrieved_chunks") == 3


def test_failed_load_is_recomputed(engine: Engine, server: ServerProcess) -> None:
    # With several KV cache groups vLLM takes failed loads by request (block ids name
    # one group's block only); the request is recomputed whole and stored again.
    prompt = tokens(70, 3 * CHUNK)
    reference = cold(engine, prompt)
    engine.reset_prefix_cache()
    before = server.stats()
    engine.generate([prompt])
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 3)
    engine.reset_prefix_cache()
    before = server.stats()
    engine.send(op="generate", prompts=[prompt], max_tokens=8, salt=None)
    eventually(server, lambda s: delta(s, before, "hit_tokens") == 3 * CHUNK)
    eventually(server, lambda s: delta(s, before, "expired_lookups") >= 1, timeout=10)
    with AdminClient(server.url) as admin:
        assert admin.clear() >= 3
    out = engine.receive(timeout=120)["outputs"][0]
    assert_same_output(out, reference)
    assert delta(server.stats(), before, "retrieve_errors") == 1
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 3)
