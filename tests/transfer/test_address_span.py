"""The staged copy's indexing (rows of one span over every allocation), checked on CPU
memory against the plain per-segment copier."""

from __future__ import annotations

import numpy as np
import torch

from kvdepot.client.memory_export import infer_block_axis
from kvdepot.protocol import LayerSpec
from kvdepot.transfer.address_span import AddressSpan, expand_rows, word_rows
from kvdepot.transfer.cpu_copier import CPUCopier
from kvdepot.transfer.layout import KVLayout

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
    CPUCopier([a.numpy() for a in allocations]).gather(plan, expected)

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
    CPUCopier([a.numpy() for a in allocations]).gather(plan, again)
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
