"""Preemption under a tight KV cache: freed blocks are never raced, outputs stay exact."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.support.harness import CHUNK, DepotServer, Engine, assert_same_output, tokens

# Each test may start engines (about a minute each on two cores).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

NUM_BLOCKS = 14  # 1792 tokens: two of the requests below fit, three do not


@pytest.fixture(scope="module")
def engine(model_dir: Path, server: DepotServer, log_dir: Path) -> Iterator[Engine]:
    eng = Engine(
        model_dir, server.url, log_dir / "engine-preemption.log",
        llm_kwargs={"num_gpu_blocks_override": NUM_BLOCKS, "max_model_len": 1536,
                    "disable_log_stats": False},
        # Generated chunks are stored too, so a resumed request can load them.
        store_generated=True,
    )
    yield eng
    eng.close()


def test_preempted_requests_finish_with_the_unpreempted_output(
    engine: Engine, server: DepotServer
) -> None:
    prompts = [tokens(40 + i, 2 * CHUNK + 100) for i in range(3)]
    # One at a time nothing is preempted: these are the reference outputs.
    references = [engine.generate([p], max_tokens=300, salt="reference")[0] for p in prompts]
    preemptions = engine.metrics().get("vllm:num_preemptions", 0)

    engine.reset_prefix_cache()
    outputs = engine.generate(prompts, max_tokens=300, timeout=600)
    assert engine.metrics().get("vllm:num_preemptions", 0) > preemptions, "nothing was preempted"
    for out, ref in zip(outputs, references, strict=True):
        assert_same_output(out, ref)
