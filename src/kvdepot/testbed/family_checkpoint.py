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
