"""The staged copy's indexing (rows of one span over every allocation), checked on CPU
memory against the plain per-segment copier."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvdepot.client.kv_export import infer_block_axis
from kvdepot.protocol import LayerSpec
from kvdepot.transfer.address_span import AddressSpan, BlockRows, expand_rows, word_rows
from kvdepot.transfer.cpu_copier import copy_blocks
from kvdepot.transfer.cuda_copier import STAGING_BYTES, batch_arrays, copy_path, staged_copy
from kvdepot.transfer.host_chunks import HostChunks
from kvdepot.transfer.layout import CopyPlan, KVLayout

BLOCK = 16


def _layout(tensors: dict[str, torch.Tensor], allocations: list[torch.Tensor]) -> KVLayout:
    pointers = [a.data_ptr() for a in allocations]
    specs = []
    for name, t in tensors.items():
        index = pointers.index(t.untyped_storage().data_ptr())
        specs.append(LayerSpec(name, index, str(t.dtype).removeprefix("torch."), list(t.shape),
                               list(t.stride()), t.storage_offset(),
                               infer_block_axis(name, t, BLOCK)))
    return KVLayout(specs, [a.numel() for a in allocations], BLOCK)


def _byte_views(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors.values():
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), torch.empty(0, dtype=torch.uint8).set_(storage))
    return list(seen.values())


def _check(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        t.view(torch.int16).random_(-32768, 32767)
    allocations = _byte_views(tensors)
    layout = _layout(tensors, allocations)
    rng = np.random.default_rng(0)
    ids = rng.choice(layout.num_blocks, 2 * 16, replace=False).astype(np.int64)
    plan = layout.plan(ids, 16)
    nbytes = layout.chunk_bytes(256)
    expected = [np.zeros(nbytes, np.uint8) for _ in range(2)]
    copy_blocks([a.numpy() for a in allocations], plan, expected, to_host=True)

    span = AddressSpan(allocations)
    row = span.row_bytes(plan)
    index = torch.from_numpy(expand_rows(span.engine_offsets(plan), plan.length, row))
    staging = torch.zeros(2 * nbytes, dtype=torch.uint8)
    torch.index_select(span.rows(row), 0, index, out=word_rows(staging, row, span.base))
    assert np.array_equal(staging.numpy(), np.concatenate(expected))

    # And back: scatter the staged bytes into zeroed engine memory.
    for a in allocations:
        a.zero_()
    span.rows(row).index_copy_(0, index, word_rows(staging, row, span.base))
    again = [np.zeros(nbytes, np.uint8) for _ in range(2)]
    copy_blocks([a.numpy() for a in allocations], plan, again, to_host=True)
    assert np.array_equal(np.concatenate(again), np.concatenate(expected))


def test_separate_allocations() -> None:
    _check({f"l{i}": torch.empty(2, 64, BLOCK, 2, 8, dtype=torch.bfloat16) for i in range(3)})


def test_views_into_one_block_outermost_allocation() -> None:
    whole = torch.empty(64, 3, 2, BLOCK, 2, 8, dtype=torch.bfloat16)
    _check({f"l{i}": whole[:, i].transpose(0, 1) for i in range(3)})


def test_mla_separate_allocations() -> None:
    _check({f"l{i}": torch.empty(64, BLOCK, 576, dtype=torch.bfloat16) for i in range(3)})


def test_long_segments() -> None:
    _check({f"l{i}": torch.empty(2, 40, BLOCK, 8, 64, dtype=torch.bfloat16) for i in range(2)})


# ---- the staged copy as the CUDA copier runs it: row pattern per layout, index per op ----
def _vllm_views(order: str) -> dict[str, torch.Tensor]:
    """vLLM 0.32's `[B, H, N, C]` per-layer views over one allocation laid out in `order`."""
    sizes = {"L": 3, "B": 40, "H": 2, "N": BLOCK, "C": 16}
    physical = torch.empty([sizes[d] for d in order], dtype=torch.bfloat16)
    logical = physical.permute([order.index(d) for d in "LBHNC"])
    return {f"l{i}": logical[i] for i in range(3)}


def _mixed_layers() -> dict[str, torch.Tensor]:
    """Layers of different widths, so their block strides differ (the non-uniform index)."""
    return {"l0": torch.empty(2, 40, BLOCK, 2, 8, dtype=torch.bfloat16),
            "l1": torch.empty(2, 40, BLOCK, 4, 8, dtype=torch.bfloat16),
            "l2": torch.empty(40, BLOCK, 24, dtype=torch.bfloat16)}


STAGED_CASES = {
    "flash_attn": lambda: {f"l{i}": torch.empty(2, 40, BLOCK, 2, 8, dtype=torch.bfloat16)
                           for i in range(3)},
    "flash_attn_shared": lambda: (lambda w: {"l0": w[0], "l1": w[1], "alias": w[1]})(
        torch.empty(2, 2, 40, BLOCK, 2, 8, dtype=torch.bfloat16)),
    "mla": lambda: {f"l{i}": torch.empty(40, BLOCK, 576, dtype=torch.bfloat16)
                    for i in range(3)},
    "mla_cross_layer": lambda: (lambda w: {f"l{i}": w[:, i] for i in range(3)})(
        torch.empty(40, 3, BLOCK, 576, dtype=torch.bfloat16)),
    "mixed_layers": _mixed_layers,
    **{f"vllm_{o}": (lambda o=o: _vllm_views(o)) for o in ("LBHNC", "BLHNC", "BLNHC", "BHLNC")},
}


def _staged(tensors: dict[str, torch.Tensor], allocations: list[torch.Tensor],
            layout: KVLayout, plan: CopyPlan, chunks: HostChunks, to_host: bool,
            limit: int) -> BlockRows:
    span = AddressSpan(allocations)
    rows = BlockRows(span, layout.block_segments, torch.device("cpu"))
    index = rows.index(torch.from_numpy(plan.block_ids.astype(np.int64)).view(-1, 1))
    stages = _OneBuffer(plan.nbytes + 3 * layout.block_bytes, rows.row_bytes, span.base)
    staged_copy(plan, rows, index, stages, chunks, to_host, limit)
    assert stages.pieces == stages.ended == (len(plan.chunk_ranges()) if limit == 1 else 1)
    return rows


class _OneBuffer:
    """`Stages` on CPU memory: one buffer (filled with junk), the calls counted."""

    def __init__(self, nbytes: int, row_bytes: int, span_base: int) -> None:
        self.staging = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
        self.rows = word_rows(self.staging, row_bytes, span_base)
        self.pieces = self.handoffs = self.ended = 0

    def begin(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert nbytes <= self.staging.numel() and self.handoffs == self.pieces
        self.pieces += 1
        return self.staging, self.rows

    def handoff(self) -> None:
        self.handoffs += 1

    def end(self) -> None:
        assert self.handoffs == self.pieces
        self.ended += 1


def _chunk_buffers(kind: str, count: int, nbytes: int) -> HostChunks:
    """`count` zeroed chunk buffers in one pool (as the CPU tier hands them out), back to
    back or in another order with gaps."""
    pool = torch.zeros((2 * count + 1) * nbytes, dtype=torch.uint8)
    slots = range(count) if kind == "pool" else [2 * (count - i) for i in range(count)]
    return HostChunks(pool, [i * nbytes for i in slots], nbytes)


@pytest.mark.parametrize("case", sorted(STAGED_CASES))
@pytest.mark.parametrize("limit", [STAGING_BYTES, 1])
@pytest.mark.parametrize("buffers", ["pool", "pool_apart"])
def test_staged_copy_matches_the_segment_copier(case: str, limit: int, buffers: str) -> None:
    """Every block's bytes land where the per-segment CPU copy puts them, both ways, with
    `first_slot` leaving the skipped blocks untouched; limit 1 makes a piece per chunk.
    Chunks back to back in one pool move as one DMA per piece; the result is the same."""
    tensors = STAGED_CASES[case]()
    allocations = _byte_views(tensors)
    for a in allocations:
        a.view(torch.int16).random_(-32768, 32767)
    layout = _layout(tensors, allocations)
    bpc = 4
    nbytes = layout.chunk_bytes(bpc * BLOCK)
    rng = np.random.default_rng(len(case))
    ids = rng.choice(layout.num_blocks, 3 * bpc, replace=False).astype(np.int32)
    expected = [np.zeros(nbytes, np.uint8) for _ in range(3)]
    engine = [a.numpy() for a in allocations]
    copy_blocks(engine, layout.plan(ids, bpc), expected, to_host=True)
    got = _chunk_buffers(buffers, 3, nbytes)
    rows = _staged(tensors, allocations, layout, layout.plan(ids, bpc), got, True, limit)
    for g, e in zip(got.each, expected, strict=True):
        assert np.array_equal(g.numpy(), e)
    if case == "mixed_layers":
        assert rows._strides is not None  # the per-row stride path was the one tested
    elif case.endswith("BLHNC") or case == "mla_cross_layer":
        assert len(layout.block_segments) == 1  # a block is one segment across layers

    # Back into other blocks, skipping the first 5 slots (a chunk and a bit).
    before = [a.clone() for a in allocations]
    targets = np.setdiff1d(np.arange(layout.num_blocks), ids)[:3 * bpc].astype(np.int32)
    skip = bpc + 1
    _staged(tensors, allocations, layout, layout.plan(targets, bpc, first_slot=skip),
            got, False, limit)
    assert all(np.array_equal(g.numpy(), e)
               for g, e in zip(got.each, expected, strict=True))  # unchanged
    want = [a.clone() for a in before]
    copy_blocks([w.numpy() for w in want], layout.plan(targets, bpc, first_slot=skip),
                expected, to_host=False)
    for a, w in zip(allocations, want, strict=True):
        assert torch.equal(a, w)
    # And independently of the CPU copier: the skipped blocks hold what they held.
    check = [np.zeros(layout.block_bytes, np.uint8) for _ in range(skip)]
    old = [np.zeros(layout.block_bytes, np.uint8) for _ in range(skip)]
    copy_blocks(engine, layout.plan(targets[:skip], 1), check, to_host=True)
    copy_blocks([b.numpy() for b in before], layout.plan(targets[:skip], 1), old, to_host=True)
    assert all(np.array_equal(c, o) for c, o in zip(check, old, strict=True))


@pytest.mark.parametrize("case", sorted(STAGED_CASES))
def test_copy_bound_is_an_upper_bound(case: str) -> None:
    tensors = STAGED_CASES[case]()
    layout = _layout(tensors, _byte_views(tensors))
    rng = np.random.default_rng(3)
    for consecutive in (False, True):
        ids = (np.arange(8, 16) if consecutive
               else rng.choice(layout.num_blocks, 8, replace=False))
        plan = layout.plan(ids, 4)
        assert plan.nbytes / len(plan) <= plan.mean_copy_bound() + 1e-9


def test_chunk_ranges_follow_the_slots() -> None:
    tensors = STAGED_CASES["mla"]()
    layout = _layout(tensors, _byte_views(tensors))
    bb = layout.block_bytes
    plan = layout.plan(np.arange(10), 4, first_slot=3)
    assert plan.chunk_ranges() == [(0, 3 * bb, bb, 0, 1), (1, 0, 4 * bb, 1, 5),
                                   (2, 0, 2 * bb, 5, 7)]
    assert layout.plan(np.arange(8), 4, first_slot=8).chunk_ranges() == []


def test_dma_runs_join_chunks_back_to_back_in_one_pool() -> None:
    """One DMA per run of ranges whose host bytes follow each other in the pool; a gap or
    another order starts a new one."""
    n = 64
    pool = torch.arange(8 * n, dtype=torch.uint8)
    whole = [(0, 16, n - 16, 0, 3), (1, 0, n, 3, 7), (2, 0, 32, 7, 9)]  # a retrieve's shape

    def spans(offsets: list[int]) -> list[tuple[bytes, int]]:
        return [(bytes(t.numpy()), block)
                for t, block in HostChunks(pool, offsets, n).dma_runs(whole)]

    def pool_bytes(start: int, end: int) -> bytes:
        return bytes(pool[start:end].numpy())

    adjacent = [0, n, 2 * n]
    assert spans(adjacent) == [(pool_bytes(16, 2 * n + 32), 0)]
    assert spans([0, n, 3 * n]) == [(pool_bytes(16, 2 * n), 0),
                                    (pool_bytes(3 * n, 3 * n + 32), 7)]
    assert len(spans([2 * n, n, 0])) == 3
    # A partial chunk in the middle leaves a hole in host memory: no joining across it.
    holed = [(0, 0, n, 0, 4), (1, 0, n - 16, 4, 7), (2, 0, n, 7, 11)]
    runs = HostChunks(pool, adjacent, n).dma_runs(holed)
    assert [(t.numel(), block) for t, block in runs] == [(2 * n - 16, 0), (n, 7)]


def _apply(arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """What `cuMemcpyBatchAsync` does with the arrays, done on CPU memory."""
    for dst, src, n in zip(*(a.tolist() for a in arrays), strict=True):
        ctypes.memmove(dst, src, n)


@pytest.mark.parametrize("case", sorted(STAGED_CASES))
@pytest.mark.parametrize("buffers", ["pool", "pool_apart"])
def test_batched_copies_match_the_segment_copier(case: str, buffers: str) -> None:
    """The addresses a batched store or retrieve hands the driver put every block's bytes
    where the per-segment CPU copy puts them, and a retrieve that skips slots leaves
    their blocks untouched."""
    tensors = STAGED_CASES[case]()
    allocations = _byte_views(tensors)
    for a in allocations:
        a.view(torch.int16).random_(-32768, 32767)
    bases = np.array([a.data_ptr() for a in allocations], dtype=np.uint64)
    layout = _layout(tensors, allocations)
    bpc = 4
    nbytes = layout.chunk_bytes(bpc * BLOCK)
    ids = np.random.default_rng(len(case)).choice(layout.num_blocks, 3 * bpc,
                                                  replace=False).astype(np.int32)
    expected = [np.zeros(nbytes, np.uint8) for _ in range(3)]
    copy_blocks([a.numpy() for a in allocations], layout.plan(ids, bpc), expected, True)
    got = _chunk_buffers(buffers, 3, nbytes)
    _apply(batch_arrays(layout.plan(ids, bpc), bases, got, to_host=True))
    for g, e in zip(got.each, expected, strict=True):
        assert np.array_equal(g.numpy(), e)

    targets = np.setdiff1d(np.arange(layout.num_blocks), ids)[:3 * bpc].astype(np.int32)
    want = [a.clone() for a in allocations]
    copy_blocks([w.numpy() for w in want], layout.plan(targets, bpc, first_slot=bpc + 1),
                expected, to_host=False)
    _apply(batch_arrays(layout.plan(targets, bpc, first_slot=bpc + 1), bases, got,
                        to_host=False))
    for a, w in zip(allocations, want, strict=True):
        assert torch.equal(a, w)


def test_stores_of_flash_attention_blocks_go_in_batches_and_retrieves_stay_staged() -> None:
    """A store waits for no one, so it takes batched DMAs where the driver has them (no
    kernel to share the engine's GPU); a retrieve is on a hit's path and stays staged;
    segments too short for DMAs are staged both ways."""
    flash = {f"l{i}": torch.empty(2, 40, BLOCK, 8, 64, dtype=torch.bfloat16)
             for i in range(3)}  # 16 KiB per layer, block and K or V
    short = STAGED_CASES["flash_attn"]()  # 512 bytes
    for tensors, store in ((flash, "batch"), (short, "kernel")):
        layout = _layout(tensors, _byte_views(tensors))
        plan = layout.plan(np.arange(0, 16, 2), 4)
        assert copy_path(plan, "auto", True, batches=True) == store
        assert copy_path(plan, "auto", True, batches=False) == "kernel"
        assert copy_path(plan, "auto", False, batches=True) == "kernel"
        for mode in ("dma", "batch", "kernel"):
            assert copy_path(plan, mode, False, batches=True) == mode
