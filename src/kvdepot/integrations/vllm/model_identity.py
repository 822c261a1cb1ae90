"""What the weights an engine computes KV with are, for the key scope (issue 24).

KV depends on the weights, not on the name they are served under: a new fine-tune
written over the same folder, another `--revision`, `--quantization` or `--dtype` under
the same name all compute other KV for the same tokens. The disk tier keeps chunks
across restarts and the shared tier across nodes, so a scope that named only the model
would hand the old weights' KV to the new ones: wrong answers and no error.

The scope therefore carries a digest of vLLM's revision, quantization, dtype and load
format (and seed when the weights are drawn at random) and of a fingerprint of the
checkpoint. The fingerprint is taken once per process at start and reads little:

- `config.json` and the other small `*config.json` / `*.index.json` files, whole;
- per weight file: its name and size, the JSON header of a `.safetensors` file (its
  8-byte length and the header, never a tensor's bytes), and a content tag: the blob's
  sha256 when the file is a link into a Hugging Face cache (content-addressed), else its
  modification time.

Headers and sizes alone cannot tell two fine-tunes of one architecture apart (same
shapes, same dtypes, same offsets), which is the very case this guards against, so the
modification time stands in for the bytes we do not read. It costs sharing between
copies that were not made with their times kept (`cp -p`, `rsync -a`): those miss,
which costs compute, never correctness; `kvdepot.model_identity` is for operators who
know the copies are the same. Paths are never part of the fingerprint: a checkpoint
moved or copied (times kept) to another folder fingerprints the same.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from blake3 import blake3

from kvdepot.protocol import MAX_NAME_CHARS

_DOMAIN = b"kvdepot/model-identity/v1"
DIGEST_CHARS = 24
"""Hex characters of the weights digest in the scope (96 bits: no accidental match)."""
_SAFETENSORS_MAX_HEADER = 100 << 20
"""The safetensors format's own bound on a header; a larger length is a broken file."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz")
_HF_BLOB = re.compile(r"[0-9a-f]{64}")
"""A Hugging Face cache blob's name: the file's sha256 (LFS files) - its content."""
_HF_SNAPSHOT = re.compile(r"[0-9a-f]{40}")
MAX_IDENTITY_CHARS = 512
"""Bound of `kvdepot.model_identity`: it travels in every key scope."""


def _small_file(name: str) -> bool:
    # config.json, quantization configs (quant_config.json, hf_quant_config.json, ...)
    # and shard indexes: all change what the loaded weights are, all are kilobytes.
    return name.endswith("config.json") or name.endswith(".index.json")


def _safetensors_header(f: Any, size: int) -> bytes:
    """The raw JSON header of an open .safetensors file: 8 + N bytes read, nothing more.
    A length that does not fit the file is reported as such instead of raising: the file
    is broken, vLLM will say so when it loads it, and its size still tells it apart."""
    head = f.read(8)
    if len(head) < 8:
        return b"<short>"
    length = int.from_bytes(head, "little")
    if length > min(size - 8, _SAFETENSORS_MAX_HEADER):
        return b"<bad-length>" + head
    header = f.read(length)
    return header if len(header) == length else b"<short-header>"


def _content_tag(path: Path, stat: os.stat_result) -> bytes:
    """What stands in for the bytes of a weight file we do not read."""
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if target.parent.name == "blobs" and _HF_BLOB.fullmatch(target.name):
            return b"sha256:" + target.name.encode()
    return b"mtime:" + str(stat.st_mtime_ns).encode()


def checkpoint_fingerprint(path: str | os.PathLike[str]) -> str:
    """A hex digest of the checkpoint at `path` (a folder, or a single weight file such as
    a .gguf), from what this module's docstring lists. Never reads a tensor's bytes."""
    root = Path(path)
    h = blake3(_DOMAIN + b"/checkpoint")

    def field(data: bytes) -> None:
        # Length-prefixed, so that no two different sequences of fields hash alike.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    files = [root] if root.is_file() else sorted(p for p in root.iterdir() if p.is_file())
    weights = 0
    for file in files:
        name = file.name
        if _small_file(name):
            field(b"file:" + name.encode())
            field(file.read_bytes())
        elif name.endswith(_WEIGHT_SUFFIXES):
            weights += 1
            stat = file.stat()
            field(b"weights:" + name.encode())
            field(str(stat.st_size).encode())
            field(_content_tag(file, stat))
            if name.endswith(".safetensors"):
                with open(file, "rb") as f:
                    field(_safetensors_header(f, stat.st_size))
    if not files:
        raise ValueError(f"{root}: no files to fingerprint the checkpoint by")
    field(b"weight-files:" + str(weights).encode())
    return h.hexdigest()


def _hub_snapshot(model: str, revision: str | None) -> Path | None:
    """The local snapshot folder vLLM loads a hub model from (the model hub itself is
    never asked: only the local cache that vLLM filled when it read the model's config)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - vLLM depends on it
        return None
    try:
        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception:  # a malformed repo id, an unreadable cache: not a hub model here
        return None
    return Path(found).parent if isinstance(found, str) else None


def checkpoint_identity(model: str, revision: str | None) -> str:
    """The fingerprint of the checkpoint vLLM loads for `model` (its `model` string).

    A local folder or file: `checkpoint_fingerprint` of it. A hub name: vLLM loads from
    the local cache's snapshot folder, whose name is the commit it holds, and a commit's
    files never change: the commit is the identity (the weights themselves may not be
    downloaded yet when the worker's connector starts, so their files are not read, and
    every process of the engine agrees). Neither: ValueError, since keys that cannot
    name the weights must not be made at all; `kvdepot.model_identity` overrides."""
    if os.path.exists(model):
        return checkpoint_fingerprint(model)
    snapshot = _hub_snapshot(model, revision)
    if snapshot is not None and _HF_SNAPSHOT.fullmatch(snapshot.name):
        return "hub:" + snapshot.name
    raise ValueError(
        f"KVDepotConnector: cannot fingerprint the weights of {model!r} (not a local path, "
        "and no snapshot of it in the Hugging Face cache). Serve a local folder, or set "
        "kv_connector_extra_config's kvdepot.model_identity to a name for these weights")


def engine_settings(vllm_config: Any) -> dict[str, str]:
    """The settings of vLLM that change the KV of the same checkpoint's weights."""
    model = vllm_config.model_config
    load = vllm_config.load_config
    load_format = str(getattr(load.load_format, "value", load.load_format))
    settings = {
        "revision": str(model.revision or ""),
        "quantization": str(model.quantization or ""),
        "dtype": str(model.dtype),
        "load_format": load_format,
        "hf_overrides": json.dumps(model.hf_overrides, sort_keys=True, default=str)
        if isinstance(model.hf_overrides, dict) else repr(model.hf_overrides),
    }
    if load_format == "dummy":  # the weights are drawn at random from the seed
        settings["seed"] = str(model.seed)
    return settings


def weights_digest(checkpoint: str, settings: dict[str, str]) -> str:
    h = blake3(_DOMAIN + b"/weights")
    for key, value in [("checkpoint", checkpoint), *sorted(settings.items())]:
        for part in (key.encode(), value.encode()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()[:DIGEST_CHARS]


def validate_identity(identity: str) -> None:
    if not identity or len(identity) > MAX_IDENTITY_CHARS or not identity.isprintable():
        raise ValueError("kvdepot.model_identity must be 1 to "
                         f"{MAX_IDENTITY_CHARS} printable characters")


def scope_model(name: str, checkpoint: str, settings: dict[str, str]) -> str:
    """The `model` of the key scope: `<name>#<digest>`. The name keeps the scope readable
    (the admin API lists chunks by it); the digest makes it name the weights."""
    scoped = f"{name}#{weights_digest(checkpoint, settings)}"
    if len(scoped) > MAX_NAME_CHARS:
        raise ValueError(f"KVDepotConnector: the model name {name[:60]!r}... is longer than "
                         f"{MAX_NAME_CHARS - DIGEST_CHARS - 1} characters; set "
                         "kvdepot.model_name to a shorter one")
    return scoped


def scope_model_for(vllm_config: Any, model_name: str, model_identity: str,
                    kv_groups: str = "") -> str:
    """The key scope's model for an engine, from vLLM's config and the connector's
    `kvdepot.model_name` / `kvdepot.model_identity` (empty: not set).

    With `model_identity` the operator names the weights: it replaces both the name and
    the checkpoint's fingerprint (so copies at other paths share chunks); vLLM's
    revision, quantization, dtype and load format still count, since they change the
    KV of the very same files. `kv_groups` (`describe_kv_groups`) counts too: an engine
    of another architecture under the same name misses instead of loading KV that
    means something else to it."""
    settings = engine_settings(vllm_config)
    if kv_groups:
        settings["kv_cache_groups"] = kv_groups
    if model_identity:
        validate_identity(model_identity)
        return scope_model(model_identity, "operator", settings)
    model = vllm_config.model_config.model
    checkpoint = checkpoint_identity(model, vllm_config.model_config.revision)
    return scope_model(model_name or model, checkpoint, settings)


def describe_kv_groups(groups: Any) -> str:
    """What vLLM's KV cache groups hold, as the key scope counts it (issue 44).

    Per group: its kind, block size, layer count, window and local-attention chunk.
    Architectures whose blocks have the same bytes, a Gemma and a gpt-oss of the same
    widths with other windows, must not read each other's chunks: the server's layout
    check compares bytes and would let such a load through. Head counts, head sizes and
    dtypes are left to that check (another layout is a failed load, recomputed:
    `tests/vllm_releases` relies on it). Within one architecture the groups do not
    change with the engine's memory or batch size, so engines that share KV keep
    sharing it."""
    parts = []
    for group in groups:
        spec = group.kv_cache_spec
        fields = [type(spec).__name__, str(spec.block_size), str(len(group.layer_names))]
        fields += [str(getattr(spec, name, None)) for name in
                   ("sliding_window", "attention_chunk_size")]
        parts.append(":".join(fields))
    return "|".join(parts)
