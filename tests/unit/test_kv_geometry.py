"""The transfer benchmark's geometries: the chunk size its argument check computes from
shapes alone is the one the server's layout computes from the real tensors."""

from __future__ import annotations

import pytest
import torch

from kvdepot.client.kv_export import describe_kv_caches
from kvdepot.testbed.kv_geometry import CPU_GEOMETRIES, CUDA_GEOMETRIES, Geometry
from kvdepot.transfer.layout import KVLayout

CHUNK = 256


@pytest.mark.parametrize("geometry", CPU_GEOMETRIES + CUDA_GEOMETRIES, ids=lambda g: g.name)
def test_chunk_bytes_from_shapes_match_the_layout_of_the_built_tensors(geometry: Geometry
                                                                       ) -> None:
    # Built on the CPU (the layouts are the same on a GPU), two chunks' worth of blocks.
    caches = geometry.build(2 * CHUNK // geometry.block_size, torch.device("cpu"))
    storages, specs = describe_kv_caches(caches, geometry.block_size)
    layout = KVLayout(specs, [s.nbytes() for s in storages], geometry.block_size)
    assert geometry.chunk_bytes(CHUNK) == layout.chunk_bytes(CHUNK)


def test_the_llama_70b_tp8_rank_holds_one_kv_head_of_80_layers() -> None:
    (geometry,) = [g for g in CUDA_GEOMETRIES if g.name == "llama70b-tp8-flash-attn"]
    caches = geometry.build(3, torch.device("meta"))
    assert len(caches) == 80
    assert {tuple(t.shape) for t in caches.values()} == {(2, 3, 16, 1, 128)}
    assert {t.dtype for t in caches.values()} == {torch.bfloat16}
    # K and V of 256 tokens, 80 layers, one head of 128 bf16 values.
    assert geometry.chunk_bytes(CHUNK) == 2 * 256 * 80 * 128 * 2
