"""The batched copy's binding (`CudaDriver.copy_batch`), against libcuda's entry points
played by Python callables that do what the driver would on CPU memory: which call is
bound (CUDA 13's `_v2`, else 12.8's with its failure index, else none), the argument
order, and the one set of attributes read in stream order."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from kvdepot.transfer import cuda_driver as cd

STREAM = 0x5EED


class _BatchLibrary:
    """Every entry point succeeds; the batched copy (only those in `calls`) copies."""

    def __init__(self, calls: tuple[str, ...]) -> None:
        self.calls = calls
        self.seen: list[tuple[str, int, int]] = []  # (call, count, stream)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("cuMemcpyBatchAsync") and name not in self.calls:
            raise AttributeError(name)

        def fn(*args: Any) -> int:
            if name.startswith("cuMemcpyBatchAsync"):
                self._copy(name, *args)
            return 0

        setattr(self, name, fn)
        return fn

    def _copy(self, name: str, dsts: Any, srcs: Any, sizes: Any, count: int, attrs: Any,
              first: Any, num_attrs: int, *rest: Any) -> None:
        failed_at, stream = rest if name == "cuMemcpyBatchAsync" else (None, *rest)
        assert (failed_at is None) == (name == "cuMemcpyBatchAsync_v2")
        attributes = attrs._obj
        assert attributes.srcAccessOrder == cd.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        assert attributes.flags == 0 and num_attrs == 1 and first._obj.value == 0

        def column(pointer: Any) -> list[int]:
            return list((ctypes.c_uint64 * count).from_address(pointer.value))

        for dst, src, n in zip(column(dsts), column(srcs), column(sizes), strict=True):
            ctypes.memmove(dst, src, n)
        self.seen.append((name, count, stream.value))


@pytest.mark.parametrize("calls", [("cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync"),
                                   ("cuMemcpyBatchAsync",)])
def test_a_batch_copies_every_range_through_the_newest_call(calls: tuple[str, ...]) -> None:
    library = _BatchLibrary(calls)
    driver = cd.CudaDriver(library)  # type: ignore[arg-type]
    assert driver.copies_in_batches
    source = np.arange(64, dtype=np.uint8)
    target = np.zeros(64, dtype=np.uint8)
    base_s, base_t = source.ctypes.data, target.ctypes.data
    # Three ranges out of order, one of them a single byte; the rest of `target` untouched.
    driver.copy_batch(np.array([base_t + 40, base_t, base_t + 63], dtype=np.uint64),
                      np.array([base_s + 8, base_s + 32, base_s + 1], dtype=np.int64),
                      np.array([16, 8, 1]), STREAM)
    want = np.zeros(64, dtype=np.uint8)
    whole = np.arange(64, dtype=np.uint8)
    want[40:56], want[0:8], want[63] = whole[8:24], whole[32:40], whole[1]
    assert np.array_equal(target, want)
    assert np.array_equal(source, whole)  # read, never written
    assert library.seen == [(calls[0], 3, STREAM)]


def test_a_driver_without_batched_copies_says_so() -> None:
    driver = cd.CudaDriver(_BatchLibrary(()))  # type: ignore[arg-type]
    assert not driver.copies_in_batches
    with pytest.raises(cd.CudaDriverError, match=r"CUDA_ERROR_NOT_SUPPORTED.*older than 12\.8"):
        driver.copy_batch(np.zeros(1, np.uint64), np.zeros(1, np.uint64),
                          np.ones(1, np.uint64), STREAM)


def test_the_attributes_struct_matches_cuda_h() -> None:
    attrs = cd.CUmemcpyAttributes
    assert ctypes.sizeof(attrs) == 24
    assert [getattr(attrs, f).offset for f in ("srcAccessOrder", "srcLocHint", "dstLocHint",
                                               "flags")] == [0, 4, 12, 20]
