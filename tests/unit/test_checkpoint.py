"""The seeded random checkpoint: written once per (config, seed), reproducible, complete."""

import json
from pathlib import Path

import pytest

pytest.importorskip("safetensors")
import torch
from safetensors.torch import load_file

from kvdepot.testbed.checkpoint import SIZES, seeded_checkpoint

TINY = {**SIZES["small"], "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}


def test_written_once_and_found_again(tmp_path: Path) -> None:
    folder = seeded_checkpoint(TINY, seed=3, root=tmp_path)
    weights = folder / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert seeded_checkpoint(dict(TINY), seed=3, root=tmp_path) == folder
    assert weights.stat().st_mtime_ns == written
    assert json.loads((folder / "config.json").read_text()) == TINY
    # Nothing half-written is left beside it.
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


def test_seed_and_config_each_give_their_own_weights(tmp_path: Path) -> None:
    a = load_file(seeded_checkpoint(TINY, seed=0, root=tmp_path) / "model.safetensors")
    b = load_file(seeded_checkpoint(TINY, seed=1, root=tmp_path) / "model.safetensors")
    wider = {**TINY, "intermediate_size": 96}
    c = load_file(seeded_checkpoint(wider, seed=0, root=tmp_path) / "model.safetensors")
    assert len(list(tmp_path.joinpath("checkpoints").iterdir())) == 3
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[name], b[name])
    assert c["model.layers.0.mlp.up_proj.weight"].shape == (96, 32)


def test_every_llama_weight_is_there_with_its_shape(tmp_path: Path) -> None:
    weights = load_file(seeded_checkpoint(TINY, root=tmp_path) / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape == (TINY["vocab_size"], 32)
    assert weights["lm_head.weight"].shape == (TINY["vocab_size"], 32)
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (32, 32)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (32, 64)
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert len(weights) == 3 + 9 * TINY["num_hidden_layers"]
