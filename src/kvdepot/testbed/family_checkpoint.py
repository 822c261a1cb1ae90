"""A small checkpoint of any architecture transformers knows, with seeded weights.

`checkpoint.py` writes Llamas by hand; the model families of issue 44 (Gemma's sliding and
global layers, DeepSeek's MLA, hybrids with recurrent layers) each name their weights
differently. Here transformers builds the model from its config, so the names are the
ones a real checkpoint of that family has, and every weight is then drawn again from a
seeded generator at the scale a trained model has (see `checkpoint.py`: vLLM's dummy
weights, like transformers' own initialisation, leave every logit near zero, so greedy
output would not depend on the prompt). Vectors (norms, biases, sinks, a recurrent
layer's decay terms) keep the values the architecture initialises them to.

`python -m kvdepot.testbed.family_checkpoint CONFIG.json` writes one and prints its folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from kvdepot.testbed.checkpoint import cache_root, written_once

# Bump when the weights written for a given config and seed change.
_FORMAT = 1

_LOGIT_GAIN = 3.0
"""The output head's gain: logits a few units apart, so greedy picks are clear."""
_ATTENTION_GAIN = 2.0
"""Query and key projections: sharper attention than the unit gain, so earlier tokens
matter to the output."""

DEEPSEEK_V2_LITE_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    # DeepSeek-V2-Lite's attention as published: 16 heads, no low-rank query projection
    # (`q_lora_rank` null), one KV latent of 512 per token beside a 64-wide rotary key
    # (576 values per token and layer in vLLM's MLA cache), heads of 128 + 64 rotary for
    # queries and keys and 128 for values.
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    # Scaled down: 4 layers of width 512, a 4096-token vocabulary (the seeded Llamas'
    # token ids), and dense MLPs in every layer (`first_k_dense_replace` = the layer
    # count; Lite has one dense layer before its experts), so no expert weights or MoE
    # kernels are needed. The expert fields are set, small, as a MoE config has them;
    # no layer uses them.
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
    "vocab_size": 4096, "max_position_embeddings": 8192,
    "first_k_dense_replace": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "moe_intermediate_size": 128, "moe_layer_freq": 1,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": False, "scoring_func": "softmax", "hidden_act": "silu",
    # Lite's YaRN scaling (factor 40 over 4096 positions) is left out: it changes the
    # rotary frequencies and the softmax scale, not what the KV cache holds, and prompts
    # here stay within 4096 tokens.
    "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
"""DeepSeek-V2-Lite scaled down, in bfloat16: multi-head latent attention (MLA) as vLLM
serves it on a GPU (`tests/gpu/test_family_mla_gpu.py`)."""


def family_checkpoint(config: dict[str, Any], seed: int = 0, root: Path | None = None) -> Path:
    """The folder of the checkpoint for (config, seed), written on first use.

    `config` is a Hugging Face `config.json` as a dict (with `model_type` and
    `architectures`). Concurrent callers are safe, as with `seeded_checkpoint`.
    """
    identity = json.dumps({"config": config, "seed": seed, "format": _FORMAT}, sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return written_once((root or cache_root()) / "checkpoints" / f"{config['model_type']}-{digest}",
                        "config.json", lambda into: _write(into, config, seed))


def _gain(name: str) -> float:
    if name.startswith("lm_head"):
        return _LOGIT_GAIN
    if any(part in name for part in ("q_proj", "k_proj", "q_a_proj", "q_b_proj", "kv_a_proj")):
        return _ATTENTION_GAIN
    return 1.0


def _write(folder: Path, config: dict[str, Any], seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **settings)
    dtype = getattr(torch, config.get("torch_dtype", "float32"))
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Sorted, so the draws do not depend on the order transformers registers modules in.
        for name, param in sorted(model.named_parameters()):
            if param.dim() < 2:
                continue
            drawn = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "embed" not in name:  # embeddings stay unit-scale, as in `checkpoint.py`
                drawn *= _gain(name) / param.shape[-1] ** 0.5
            param.copy_(drawn.to(param.dtype))
    model.save_pretrained(folder)
    # Our config, not transformers' rewrite of it: vLLM reads what a real checkpoint has.
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for written in folder.iterdir():
        written.chmod(0o644)  # safetensors writes 0600: other users' engines read it too


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvdepot.testbed.family_checkpoint",
                                     description="write a seeded checkpoint for a config.json "
                                                 "(once) and print its folder")
    parser.add_argument("config", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(family_checkpoint(json.loads(args.config.read_text()), args.seed))


if __name__ == "__main__":
    main()
