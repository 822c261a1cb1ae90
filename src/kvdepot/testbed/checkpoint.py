"""A small Llama checkpoint with seeded random weights, written once and cached on disk.

No model hub is reachable here, and vLLM's `load_format="dummy"` draws weights so small
that every logit is about 0: greedy output is the same for every prompt and any KV,
garbage included, would pass a correctness check. These weights are scaled like a
trained model's, so the next token depends on the whole prompt. The demo, the
benchmarks and the end-to-end tests all load the model from here; prompts are token
ids (no tokenizer is needed).

`python -m kvdepot.testbed.checkpoint [large|medium|small]` writes one and prints its folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

VOCAB = 4096
FIRST_ORDINARY_TOKEN = 10  # ids below stay free for special tokens (bos 1, eos 2)

# The geometry `bench e2e` is specified for: 8 layers, hidden 1024, 4 KV heads x 64.
LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_hidden_layers": 8,
    "vocab_size": VOCAB,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    # float32: CPUs without AVX-512 emulate bf16 slowly, and it keeps a cold run and a
    # cache hit numerically comparable.
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
}

# Llama-3.1-8B's shape, for `bench e2e --device cuda` (the layer count is the bench's
# choice); the vocabulary is the real one, so the embedding and head weigh what they do.
LLAMA_8B_CONFIG: dict[str, Any] = {
    **LLAMA_CONFIG,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
}

# Smaller models of the same family: fewer and narrower layers, so engines start and
# prefill fast. "medium" is the demo's: cold requests take seconds on two cores; "small"
# is the end-to-end tests' and the documented OpenAI-server example's.
SIZES: dict[str, dict[str, Any]] = {
    "large": LLAMA_CONFIG,
    "medium": {**LLAMA_CONFIG, "num_hidden_layers": 4, "hidden_size": 512,
               "intermediate_size": 1408, "num_attention_heads": 8},
    "small": {**LLAMA_CONFIG, "num_hidden_layers": 2, "hidden_size": 256,
              "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096},
}

# Bump when the weights written for a given config and seed change, so old caches go unused.
_FORMAT = 1


def cache_root() -> Path:
    """$KVDEPOT_CACHE_DIR, else $XDG_CACHE_HOME/kvdepot, else ~/.cache/kvdepot."""
    if explicit := os.environ.get("KVDEPOT_CACHE_DIR"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kvdepot"


def seeded_checkpoint(config: dict[str, Any] = LLAMA_CONFIG, seed: int = 0,
                      root: Path | None = None, device: str = "cpu") -> Path:
    """The folder of the checkpoint for (config, seed), written on first use.

    Concurrent callers are safe: each writes into a private folder and renames it into
    place; the first rename wins and the others discard their copy. `device`: where the
    weights are drawn ("cuda" for models of billions of weights; other draws than the
    CPU's, so part of the checkpoint's identity).
    """
    drawn = {} if device == "cpu" else {"device": device}
    identity = json.dumps({"config": config, "seed": seed, "format": _FORMAT, **drawn},
                          sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return written_once((root or cache_root()) / "checkpoints" / f"llama-{digest}",
                        "model.safetensors", lambda into: _write(into, config, seed, device))


def written_once(folder: Path, marker: str, write: Callable[[Path], None]) -> Path:
    """`folder`, written by `write` into a private folder and renamed into place unless
    `folder/marker` is there already: concurrent callers are safe (the first rename
    wins, the others discard their copy)."""
    if (folder / marker).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".writing-", dir=folder.parent))
    scratch.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
    try:
        write(scratch)
        try:
            scratch.rename(folder)
        except OSError:
            if not (folder / marker).exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def _write(folder: Path, config: dict[str, Any], seed: int, device: str = "cpu") -> None:
    import torch
    from safetensors.torch import save_file  # comes with vLLM

    hidden, inter, head = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_dim = config["num_attention_heads"] * head
    kv_dim = config["num_key_value_heads"] * head
    vocab = config["vocab_size"]
    gen = torch.Generator(device).manual_seed(seed)
    dtype = getattr(torch, config.get("torch_dtype", "float32"))

    def stored(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).cpu()

    def linear(out_dim: int, in_dim: int, gain: float = 1.0) -> torch.Tensor:
        return stored(torch.randn(out_dim, in_dim, generator=gen, device=device)
                      * (gain / in_dim**0.5))

    weights = {
        "model.embed_tokens.weight": stored(torch.randn(vocab, hidden, generator=gen,
                                                        device=device)),
        "model.norm.weight": torch.ones(hidden, dtype=dtype),
        # Logits a few units apart: greedy picks are clear choices, not near-ties.
        "lm_head.weight": linear(vocab, hidden, gain=3.0),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            # Sharper attention than the unit gain gives, so earlier tokens matter.
            p + "self_attn.q_proj.weight": linear(q_dim, hidden, gain=2.0),
            p + "self_attn.k_proj.weight": linear(kv_dim, hidden, gain=2.0),
            p + "self_attn.v_proj.weight": linear(kv_dim, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, q_dim),
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
        }
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvdepot.testbed.checkpoint",
                                     description="write a seeded random Llama checkpoint "
                                                 "(once) and print its folder")
    parser.add_argument("size", nargs="?", choices=sorted(SIZES), default="large")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(seeded_checkpoint(SIZES[args.size], args.seed))


if __name__ == "__main__":
    main()
