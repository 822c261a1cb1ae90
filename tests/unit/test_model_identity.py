"""Issue 24, part 2: the checkpoint fingerprint and the key scope's model that names the
weights (kvdepot.integrations.vllm.model_identity), on real files."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvdepot.integrations.vllm.model_identity import (
    checkpoint_fingerprint,
    checkpoint_identity,
    scope_model_for,
)

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}


def header(tensors: dict[str, list[int]]) -> bytes:
    """A safetensors header for float32 tensors of these shapes, laid end to end."""
    meta: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        size = 4
        for dim in shape:
            size *= dim
        meta[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(meta).encode()
    return struct.pack("<Q", len(raw)) + raw


def write_checkpoint(folder: Path, weights: bytes = b"\x01" * 64,
                     tensors: dict[str, list[int]] | None = None,
                     config: dict | None = None, mtime_ns: int = 1_700_000_000 * 10**9) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    path = folder / "model.safetensors"
    path.write_bytes(header(tensors or {"w": [4, 4]}) + weights)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    (folder / "tokenizer.model").write_bytes(b"not part of the weights")
    return folder


def test_same_checkpoint_at_another_path_fingerprints_the_same(tmp_path: Path) -> None:
    a = checkpoint_fingerprint(write_checkpoint(tmp_path / "node-a" / "model"))
    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    shutil.move(tmp_path / "node-a" / "model", moved)
    assert checkpoint_fingerprint(moved) == a
    # A copy that keeps the files' times (cp -p, rsync -a) is the same checkpoint too.
    shutil.copytree(moved, tmp_path / "copy", copy_function=shutil.copy2)
    assert checkpoint_fingerprint(tmp_path / "copy") == a


def test_config_header_size_or_rewrite_change_the_fingerprint(tmp_path: Path) -> None:
    base = checkpoint_fingerprint(write_checkpoint(tmp_path / "base"))
    changed = {
        "config": write_checkpoint(tmp_path / "config", config={**CONFIG, "rope_theta": 5e5}),
        "header": write_checkpoint(tmp_path / "header", tensors={"w": [2, 8]}),
        "size": write_checkpoint(tmp_path / "size", weights=b"\x01" * 65),
        # Same header, same size, other bytes written later: a new fine-tune over the
        # same folder. Only the file's modification time tells, since no tensor is read.
        "rewritten": write_checkpoint(tmp_path / "rewritten", weights=b"\x02" * 64,
                                      mtime_ns=1_700_000_001 * 10**9),
    }
    prints = {what: checkpoint_fingerprint(path) for what, path in changed.items()}
    assert base not in prints.values(), prints
    assert len(set(prints.values())) == len(prints)
    # A file that is not part of the weights (the tokenizer) does not count.
    (tmp_path / "base" / "tokenizer.model").write_bytes(b"another tokenizer")
    assert checkpoint_fingerprint(tmp_path / "base") == base


def test_never_reads_past_the_header(tmp_path: Path) -> None:
    """A terabyte of weights that were never written (a sparse file): reading them would
    take the test past its timeout; the fingerprint reads the header and stats the size.
    The same header over a truncated file still fingerprints, differently."""
    folder = write_checkpoint(tmp_path / "sparse", weights=b"")
    path = folder / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(1 << 40)
    os.utime(path, ns=(10**18, 10**18))
    sparse = checkpoint_fingerprint(folder)
    with open(path, "r+b") as f:
        f.truncate(len(header({"w": [4, 4]})) + 3)  # most of the tensor's bytes gone
    os.utime(path, ns=(10**18, 10**18))
    assert checkpoint_fingerprint(folder) != sparse  # the size counts


def test_a_broken_header_still_fingerprints(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "broken")
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 50) + b"{}")  # a length past the file's end
    first = checkpoint_fingerprint(folder)
    path.write_bytes(b"\x01\x02")  # shorter than the length itself
    assert checkpoint_fingerprint(folder) != first


def test_hub_name_without_a_local_snapshot_is_refused() -> None:
    """Keys that cannot name the weights are not made: the engine says what to set."""
    with pytest.raises(ValueError, match=r"kvdepot\.model_identity"):
        checkpoint_identity("kvdepot-test-org/no-such-model", None)


def vllm_config(model: str, dtype: str = "float32", quantization: str | None = None,
                revision: str | None = None) -> SimpleNamespace:
    """The fields of vLLM's config the scope reads (the e2e tests use vLLM's own)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=revision, quantization=quantization,
                                     dtype=dtype, hf_overrides={}, seed=0),
        load_config=SimpleNamespace(load_format="auto"))


def test_scope_names_the_weights_and_the_override_the_copies(tmp_path: Path) -> None:
    a = str(write_checkpoint(tmp_path / "a"))
    b = str(write_checkpoint(tmp_path / "b", weights=b"\x02" * 64,
                             mtime_ns=1_700_000_002 * 10**9))
    scope = scope_model_for(vllm_config(a), "served", "")
    assert scope.startswith("served#")
    assert scope_model_for(vllm_config(a), "served", "") == scope  # stable
    others = [scope_model_for(vllm_config(b), "served", ""),
              scope_model_for(vllm_config(a, dtype="bfloat16"), "served", ""),
              scope_model_for(vllm_config(a, quantization="fp8"), "served", ""),
              scope_model_for(vllm_config(a, revision="v2"), "served", "")]
    assert scope not in others and len(set(others)) == len(others)
    # The operator's identity replaces name and fingerprint: other weights, other paths.
    assert (scope_model_for(vllm_config(a), "", "fleet-llama")
            == scope_model_for(vllm_config(b), "", "fleet-llama"))
    assert (scope_model_for(vllm_config(a), "", "fleet-llama")
            != scope_model_for(vllm_config(a, dtype="bfloat16"), "", "fleet-llama"))
    with pytest.raises(ValueError, match="printable"):
        scope_model_for(vllm_config(a), "", "bad\nidentity")
