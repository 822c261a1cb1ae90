"""The KV caches the transfer benchmark registers: real model geometries in the tensor
layouts engines use, built the way the engine would hand them to `register_kv_caches`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvdepot.client.kv_export import infer_block_axis
from kvdepot.transfer.layout import blocks_per_chunk

Builder = Callable[[int, torch.device], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Geometry:
    name: str
    description: str
    block_size: int
    build: Builder
    """num_blocks, device -> {layer name: KV tensor}"""

    def chunk_bytes(self, chunk_size: int) -> int:
        """Bytes of one chunk over every layer, from the shapes alone (no memory: the
        tensors are built on the meta device), so arguments can be checked up front."""
        one_block = 0
        for name, tensor in self.build(1, torch.device("meta")).items():
            axis = infer_block_axis(name, tensor, self.block_size)
            one_block += tensor.numel() // tensor.shape[axis] * tensor.element_size()
        return one_block * blocks_per_chunk(chunk_size, self.block_size)


def vllm_views(order: str, layers: int, heads: int, block: int, content: int,
               dtype: torch.dtype = torch.bfloat16) -> Builder:
    """vLLM 0.32: one allocation of logical shape `[L, B, H, N, C]` (C holds K and V) laid
    out in memory in `order`; each layer is handed its `[B, H, N, C]` view."""
    def build(num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
        sizes = {"L": layers, "B": num_blocks, "H": heads, "N": block, "C": content}
        physical = torch.empty([sizes[d] for d in order], dtype=dtype, device=device)
        logical = physical.permute([order.index(d) for d in "LBHNC"])
        return {f"model.layers.{i}.self_attn": logical[i] for i in range(layers)}
    return build


def flash_attn(layers: int, heads: int, block: int, head_dim: int,
               dtype: torch.dtype = torch.bfloat16) -> Builder:
    """Classic FlashAttention: a `[2, B, N, H, D]` tensor per layer."""
    def build(num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {f"model.layers.{i}.self_attn": torch.empty(
            2, num_blocks, block, heads, head_dim, dtype=dtype, device=device)
            for i in range(layers)}
    return build


def mla(layers: int, block: int, dim: int, dtype: torch.dtype = torch.bfloat16) -> Builder:
    """MLA latent cache: a `[B, N, dim]` tensor per layer."""
    def build(num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {f"model.layers.{i}.self_attn": torch.empty(
            num_blocks, block, dim, dtype=dtype, device=device) for i in range(layers)}
    return build


CPU_GEOMETRIES = [
    Geometry("cpu-lbhnc", "32 layers, 8 KV heads x 128, bf16, block 128, vLLM CPU LBHNC", 128,
             vllm_views("LBHNC", 32, 8, 128, 2 * 128)),
]

CUDA_GEOMETRIES = [
    Geometry("llama8b-flash-attn",
             "Llama-3.1-8B (32 layers, 8 KV heads x 128, bf16), block 16, FlashAttention "
             "[2, B, N, H, D] per layer", 16, flash_attn(32, 8, 16, 128)),
    Geometry("llama70b-tp8-flash-attn",
             "Llama-3.1-70B, one rank of tensor parallelism 8 (80 layers, 1 KV head x 128, "
             "bf16), block 16, FlashAttention [2, B, N, H, D] per layer", 16,
             flash_attn(80, 1, 16, 128)),
    Geometry("llama8b-cross-layer",
             "Llama-3.1-8B, block 16, vLLM 0.32 cross-layer BLHNC (a block's 32 layers "
             "together)", 16, vllm_views("BLHNC", 32, 8, 16, 2 * 128)),
    Geometry("llama8b-cross-layer-nhc",
             "Llama-3.1-8B, block 16, vLLM 0.32 cross-layer BLNHC (tokens before heads)", 16,
             vllm_views("BLNHC", 32, 8, 16, 2 * 128)),
    Geometry("deepseek-mla",
             "DeepSeek-V3 MLA (61 layers, 576 dims, bf16), block 64, a tensor per layer", 64,
             mla(61, 64, 576)),
]
