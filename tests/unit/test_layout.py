import numpy as np
import pytest
import torch

from kvdepot.client.kv_export import infer_block_axis
from kvdepot.errors import InvalidRequest
from kvdepot.protocol import LayerSpec
from kvdepot.transfer.cpu_copier import copy_blocks
from kvdepot.transfer.layout import KVLayout
from tests.support.layouts import LAYOUTS, block_axis, blocks, fill_random, make_kv_caches

BS = 16
CHUNK = 64
BPC = CHUNK // BS


def describe(caches: dict[str, torch.Tensor]) -> tuple[KVLayout, list[np.ndarray]]:
    """What the server builds from a registration, in process (the memory is not shared)."""
    storages: dict[int, int] = {}
    arrays: list[np.ndarray] = []
    specs = []
    for name, t in caches.items():
        s = t.untyped_storage()
        if s.data_ptr() not in storages:
            storages[s.data_ptr()] = len(arrays)
            arrays.append(torch.empty(0, dtype=torch.uint8).set_(s).numpy())
        specs.append(LayerSpec(name, storages[s.data_ptr()], str(t.dtype)[6:], list(t.shape),
                               list(t.stride()), t.storage_offset(),
                               infer_block_axis(name, t, BS)))
    return KVLayout(specs, [a.nbytes for a in arrays], BS), arrays


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_moves_exactly_the_named_blocks(layout):
    src = make_kv_caches(layout, num_layers=3, num_blocks=12, block_size=BS)
    dst = make_kv_caches(layout, num_layers=3, num_blocks=12, block_size=BS)
    fill_random(src, seed=1)
    kv_src, mem_src = describe(src)
    kv_dst, mem_dst = describe(dst)
    assert kv_src.fingerprint == kv_dst.fingerprint
    assert infer_block_axis("x", next(iter(src.values())), BS) == block_axis(layout)
    src_ids, dst_ids = [9, 2, 5, 0, 11, 3, 4, 7], [1, 3, 5, 7, 8, 10, 0, 2]
    nbytes = kv_src.chunk_bytes(CHUNK)
    chunks = [np.zeros(nbytes, dtype=np.uint8) for _ in range(2)]
    copy_blocks(mem_src, kv_src.plan(np.array(src_ids), BPC), chunks, to_host=True)
    copy_blocks(mem_dst, kv_dst.plan(np.array(dst_ids), BPC), chunks, to_host=False)
    for a, b in zip(blocks(src, layout, src_ids), blocks(dst, layout, dst_ids), strict=True):
        assert torch.equal(a, b)
    untouched = [i for i in range(12) if i not in dst_ids]
    assert all(bool((t == 0).all()) for t in blocks(dst, layout, untouched))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_skipped_slots_are_not_written(layout):
    src = make_kv_caches(layout, num_layers=2, num_blocks=8, block_size=BS)
    dst = make_kv_caches(layout, num_layers=2, num_blocks=8, block_size=BS)
    fill_random(src, seed=2)
    kv_src, mem_src = describe(src)
    kv_dst, mem_dst = describe(dst)
    chunks = [np.zeros(kv_src.chunk_bytes(CHUNK), dtype=np.uint8)]
    copy_blocks(mem_src, kv_src.plan(np.array([0, 1, 2, 3]), BPC), chunks, to_host=True)
    copy_blocks(mem_dst, kv_dst.plan(np.array([4, 5, 6, 7]), BPC, first_slot=2), chunks,
                to_host=False)
    assert all(bool((t == 0).all()) for t in blocks(dst, layout, [4, 5]))
    for a, b in zip(blocks(src, layout, [2, 3]), blocks(dst, layout, [6, 7]), strict=True):
        assert torch.equal(a, b)


def test_adjacent_segments_merge_into_large_copies():
    caches = make_kv_caches("cross_layer", num_layers=4, num_blocks=8, block_size=BS, alias=False)
    kv, _ = describe(caches)
    plan = kv.plan(np.array([3, 4, 5, 6]), BPC)
    assert len(plan) == 1  # consecutive blocks of a block-outermost layout: one copy
    assert plan.length[0] == kv.chunk_bytes(CHUNK)


def test_aliased_layers_are_copied_once():
    with_alias = describe(make_kv_caches("flash_attn", 2, 4, BS, alias=True))[0]
    without = describe(make_kv_caches("flash_attn", 2, 4, BS, alias=False))[0]
    assert with_alias.block_bytes == without.block_bytes
    assert with_alias.fingerprint == without.fingerprint


def test_layouts_with_different_geometry_have_different_fingerprints():
    a = describe(make_kv_caches("flash_attn", 2, 4, BS, heads=2))[0]
    b = describe(make_kv_caches("flash_attn", 2, 4, BS, heads=4))[0]
    c = describe(make_kv_caches("flash_infer", 2, 4, BS, heads=2))[0]
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3


def test_out_of_range_blocks_are_rejected():
    kv, _ = describe(make_kv_caches("mla", 2, 4, BS))
    with pytest.raises(InvalidRequest, match="block id 4"):
        kv.validate_blocks(np.array([0, 4]))
    with pytest.raises(InvalidRequest, match="block id -1"):
        kv.validate_blocks(np.array([-1]))


def test_a_view_reaching_past_its_allocation_is_rejected():
    t = torch.zeros(4, BS, 8)
    spec = LayerSpec("l", 0, "float32", [8, BS, 8], list(t.stride()), 0, 0)
    with pytest.raises(InvalidRequest, match="reaches byte"):
        KVLayout([spec], [t.untyped_storage().nbytes()], BS)


def test_unknown_layout_is_refused_clearly():
    with pytest.raises(InvalidRequest, match="cannot tell"):
        infer_block_axis("l", torch.zeros(4, 7, 9), BS)


def test_export_shares_each_allocation_once():
    from kvdepot.client.kv_export import export_kv_caches
    from kvdepot.client.memory_handover import HandoverFiles

    caches = make_kv_caches("vllm_cpu", num_layers=3, num_blocks=8, block_size=BS)
    files = HandoverFiles()
    handles, layers, aliases = export_kv_caches(caches, BS, files)
    assert aliases == []
    assert len(handles) == 1 and len(files.fds) == 1 and handles[0].fd_index == 0
    assert {spec.allocation for spec in layers} == {0}
    assert all(t.untyped_storage().is_shared() for t in caches.values())
