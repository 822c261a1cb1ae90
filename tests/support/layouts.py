"""KV cache tensors in every layout kvdepot supports, as engines allocate them."""

from __future__ import annotations

import torch

LAYOUTS = ("vllm_cpu", "cross_layer", "flash_attn", "flash_infer", "mla")


def make_kv_caches(layout: str, num_layers: int, num_blocks: int, block_size: int,
                   heads: int = 2, head_dim: int = 32, device: str = "cpu",
                   dtype: torch.dtype = torch.bfloat16, alias: bool = True
                   ) -> dict[str, torch.Tensor]:
    """Per-layer views the way an engine would hand them to a connector."""
    caches: dict[str, torch.Tensor] = {}
    if layout == "vllm_cpu":
        # vLLM CPU: one int8 allocation, per layer [num_blocks, heads, block_size, K|V dims].
        per_layer = num_blocks * heads * block_size * 2 * head_dim
        raw = torch.zeros(num_layers * per_layer * dtype.itemsize, dtype=torch.int8,
                          device=device)
        flat = raw.view(dtype)
        for i in range(num_layers):
            caches[f"layers.{i}.attn"] = flat[i * per_layer:(i + 1) * per_layer].view(
                num_blocks, heads, block_size, 2 * head_dim)
    elif layout == "cross_layer":
        # Blocks outermost across layers: [num_blocks, layers, 2, block_size, heads, dim].
        raw = torch.zeros(num_blocks, num_layers, 2, block_size, heads, head_dim, dtype=dtype,
                          device=device)
        for i in range(num_layers):
            caches[f"layers.{i}.attn"] = raw[:, i]
    elif layout == "flash_attn":
        for i in range(num_layers):
            caches[f"layers.{i}.attn"] = torch.zeros(2, num_blocks, block_size, heads, head_dim,
                                                     dtype=dtype, device=device)
    elif layout == "flash_infer":
        raw = torch.zeros(num_layers, num_blocks, 2, block_size, heads, head_dim, dtype=dtype,
                          device=device)
        for i in range(num_layers):
            caches[f"layers.{i}.attn"] = raw[i]
    elif layout == "mla":
        raw = torch.zeros(num_layers, num_blocks, block_size, 576, dtype=dtype, device=device)
        for i in range(num_layers):
            caches[f"layers.{i}.attn"] = raw[i]
    else:
        raise ValueError(layout)
    if alias:
        # Some models share one KV cache between layers: the name aliases the same view.
        caches["layers.shared.attn"] = caches["layers.0.attn"]
    return caches


def block_axis(layout: str) -> int:
    return 1 if layout == "flash_attn" else 0


def blocks(caches: dict[str, torch.Tensor], layout: str, ids: list[int]) -> list[torch.Tensor]:
    """The data of blocks `ids` in every layer (copies)."""
    axis = block_axis(layout)
    index = torch.tensor(ids, dtype=torch.long, device=next(iter(caches.values())).device)
    return [t.index_select(axis, index).clone() for t in caches.values()]


def fill_random(caches: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seen: set[int] = set()
    for t in caches.values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
