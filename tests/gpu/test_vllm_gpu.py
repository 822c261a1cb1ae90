"""A real vLLM engine on the GPU with KVDepotConnector (vLLM 0.26 on the GPU machine).

Skips where no CUDA build of vLLM is installed (CI has none). A small Llama with seeded
weights in bfloat16: hits are checked against the cold run with the control that must
differ; vLLM's own hit must not wait for kvdepot; sleep mode, whose KV memory no other
process can map on this vLLM, runs the engine without kvdepot.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from kvdepot.client.admin import AdminClient  # noqa: E402
from kvdepot.testbed.checkpoint import SIZES, seeded_checkpoint  # noqa: E402
from kvdepot.testbed.correctness import check_correctness, engine_ask, probe_length  # noqa: E402
from kvdepot.testbed.server_process import ServerProcess  # noqa: E402
from kvdepot.testbed.vllm_engine import (  # noqa: E402
    evict_local_cache,
    generate,
    kv_transfer_config,
    random_tokens,
)

pytestmark = pytest.mark.vllm
CHUNK = 256
MODEL = {**SIZES["medium"], "torch_dtype": "bfloat16", "max_position_embeddings": 8192}


def engine(url: str, **options: Any) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(model=str(seeded_checkpoint(MODEL)), skip_tokenizer_init=True, seed=0,
               dtype="bfloat16", max_model_len=4096, enforce_eager=True, block_size=16,
               gpu_memory_utilization=0.3,
               kv_transfer_config=KVTransferConfig(**kv_transfer_config(url)), **options)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(chunk_size=CHUNK, l1_size="2GiB") as srv:
        yield srv


@pytest.fixture(scope="module")
def llm(server: ServerProcess) -> Iterator[Any]:
    engine_ = engine(server.url)
    yield engine_
    engine_.llm_engine.engine_core.shutdown()


def test_a_kvdepot_hit_on_the_gpu_matches_the_cold_run(llm: Any, server: ServerProcess
                                                       ) -> None:
    rng = random.Random(3)
    length = probe_length(CHUNK, 6)
    with AdminClient(server.url) as admin:
        report = check_correctness(engine_ask(llm, admin), random_tokens(rng, length),
                                   random_tokens(rng, length), CHUNK)
    assert report.failures() == [], "\n".join(report.lines())


def test_vllms_own_hit_does_not_wait_for_kvdepot(llm: Any, server: ServerProcess) -> None:
    """Once loads are timed, a prompt vLLM still holds is not topped up from kvdepot:
    the GPU computes its last tokens long before a load could bring them."""
    rng = random.Random(4)
    with AdminClient(server.url) as admin:
        for _ in range(3):  # cold runs time the prefill, hits time the loads
            prompt = random_tokens(rng, 4 * CHUNK + 100)
            generate(llm, [prompt], 2)  # a decode step after the prompt times the prefill
            evict_local_cache(llm)
            generate(llm, [prompt], 1)
        before = admin.stats()["retrieves"]
        generate(llm, [prompt], 1)  # vLLM holds all of it but its last block
        assert admin.stats()["retrieves"] == before


def test_sleep_mode_on_this_vllm_runs_the_engine_without_kvdepot(llm: Any,
                                                                  server: ServerProcess
                                                                  ) -> None:
    from kvdepot.integrations.vllm.connector import unexportable_kv_memory

    rng = random.Random(5)
    with AdminClient(server.url) as admin:
        before = admin.stats()
    sleepy = engine(server.url, enable_sleep_mode=True)
    try:
        refusal = unexportable_kv_memory(sleepy.llm_engine.vllm_config)
        prompt = random_tokens(rng, 3 * CHUNK)
        _, (cold,) = generate(sleepy, [prompt], 8)
        sleepy.sleep(level=1)
        sleepy.wake_up()
        evict_local_cache(sleepy)
        _, (again,) = generate(sleepy, [prompt], 8)
        assert again.token_ids == cold.token_ids
    finally:
        sleepy.llm_engine.engine_core.shutdown()
    with AdminClient(server.url) as admin:
        after = admin.stats()
    if refusal:  # this vLLM's sleep-mode memory cannot be shared: kvdepot stays out
        assert after["lookups"] == before["lookups"]
        assert after["registered_engines"] == before["registered_engines"]
