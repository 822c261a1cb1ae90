"""KV caches shaped the way inference engines lay them out on the GPU.

Each builder returns `{layer_name: tensor}` exactly as an engine hands it to
`register_kv_caches`: separate tensors, or strided per-layer views into one allocation.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

Builder = Callable[[int, torch.device], dict[str, torch.Tensor]]

LAYERS = 4
HEADS = 2
HEAD_DIM = 64
MLA_DIM = 576
BLOCK = 16
DTYPE = torch.bfloat16


def flash_attn(num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Classic FlashAttention: one `[2, blocks, block, heads, dim]` tensor per layer."""
    return {f"layers.{i}.attn": torch.empty(2, num_blocks, BLOCK, HEADS, HEAD_DIM, dtype=DTYPE,
                                            device=device) for i in range(LAYERS)}


def flash_attn_shared(num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Layer-outermost views into one allocation, plus an alias naming one layer twice."""
    whole = torch.empty(LAYERS, 2, num_blocks, BLOCK, HEADS, HEAD_DIM, dtype=DTYPE,
                        device=device)
    caches = {f"layers.{i}.attn": whole[i] for i in range(LAYERS)}
    caches["layers.shared.attn"] = whole[1]
    return caches


def vllm_layer_views(order: str, num_blocks: int, device: torch.device, layers: int = LAYERS,
                     heads: int = HEADS, block: int = BLOCK, content: int = 2 * HEAD_DIM,
                     dtype: torch.dtype = DTYPE) -> dict[str, torch.Tensor]:
    """vLLM 0.32's layouts: one allocation whose logical shape is `[L, B, H, N, C]` (C holds
    K and V), laid out in memory in `order` (e.g. "BLHNC": blocks outermost, all layers of
    a block together); each layer gets its `[B, H, N, C]` view."""
    sizes = {"L": layers, "B": num_blocks, "H": heads, "N": block, "C": content}
    physical = torch.empty([sizes[d] for d in order], dtype=dtype, device=device)
    logical = physical.permute([order.index(d) for d in "LBHNC"])
    return {f"layers.{i}.attn": logical[i] for i in range(layers)}


def flashinfer_hnd(num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
    """FlashInfer HND: `[blocks, 2, heads, block, dim]` views into one layer-outermost
    buffer."""
    whole = torch.empty(LAYERS, num_blocks, 2, HEADS, BLOCK, HEAD_DIM, dtype=DTYPE,
                        device=device)
    return {f"layers.{i}.attn": whole[i] for i in range(LAYERS)}


def mla(num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
    """MLA latent cache: one `[blocks, block, 576]` tensor per layer."""
    return {f"layers.{i}.attn": torch.empty(num_blocks, BLOCK, MLA_DIM, dtype=DTYPE,
                                            device=device) for i in range(LAYERS)}


def mla_cross_layer(num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
    """MLA views into one block-outermost buffer."""
    whole = torch.empty(num_blocks, LAYERS, BLOCK, MLA_DIM, dtype=DTYPE, device=device)
    return {f"layers.{i}.attn": whole[:, i] for i in range(LAYERS)}


LAYOUTS: dict[str, Builder] = {
    "flash_attn": flash_attn,
    "flash_attn_shared": flash_attn_shared,
    "flashinfer_hnd": flashinfer_hnd,
    **{f"vllm_{order}": partial(vllm_layer_views, order)
       for order in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")},
    "mla": mla,
    "mla_cross_layer": mla_cross_layer,
}


def block_axis(tensor: torch.Tensor) -> int:
    return 1 if tensor.dim() == 5 and tensor.shape[0] == 2 else 0


def blocks(tensor: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The given blocks of one layer, as a copy (block axis first)."""
    index = torch.tensor(ids, device=tensor.device)
    return tensor.index_select(block_axis(tensor), index).movedim(block_axis(tensor), 0).clone()


def fill_blocks(caches: dict[str, torch.Tensor], ids: list[int], generator: torch.Generator
                ) -> None:
    """Random bits (every bit pattern, NaNs included) into the given blocks of every layer."""
    index = torch.tensor(ids, device=next(iter(caches.values())).device)
    for tensor in caches.values():
        axis = block_axis(tensor)
        shape = list(tensor.shape)
        shape[axis] = len(ids)
        bits = torch.randint(-32768, 32767, shape, dtype=torch.int16, device=tensor.device,
                             generator=generator)
        tensor.index_copy_(axis, index, bits.view(tensor.dtype))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))
