"""LoadStoreOp's block ids: one list, one list per KV cache group, or an array."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdepot.client.engine_types import LoadStoreOp


@pytest.mark.parametrize("block_ids", [
    [3, 4, 5],
    (3, 4, 5),
    np.array([3, 4, 5], dtype=np.int64),
    torch.tensor([3, 4, 5]),
], ids=["list", "tuple", "numpy", "tensor"])
def test_a_flat_sequence_is_one_group(block_ids: object) -> None:
    op = LoadStoreOp(token_ids=list(range(48)), block_ids=block_ids, start=0, end=48)
    assert [[int(b) for b in group] for group in op.group_block_ids()] == [[3, 4, 5]]
    assert len(op) == 3


def test_nested_lists_are_one_group_each() -> None:
    op = LoadStoreOp(token_ids=list(range(32)), block_ids=[[1, 2], [-1, 7]], start=0, end=32)
    assert op.group_block_ids() == [[1, 2], [-1, 7]]
    assert len(op) == 2


@pytest.mark.parametrize("empty", [[], np.array([], dtype=np.int64)], ids=["list", "numpy"])
def test_no_blocks(empty: object) -> None:
    op = LoadStoreOp(token_ids=[], block_ids=empty, start=0, end=0)
    assert len(op) == 0
