"""The worker's choice between CUDA IPC and a driver-mapped (VMM) export, and its
refusals, against a fake driver that answers as libcuda does (tests/gpu has the real
one); and the ctypes bindings' error reports and struct layouts."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvdepot.client import cuda_vmm_export
from kvdepot.client.memory_handover import HandoverFiles
from kvdepot.errors import InvalidRequest
from kvdepot.transfer import cuda_driver as cd

GRANULE = 2 << 20


@dataclass
class FakeDriver:
    """Driver-mapped allocations at `allocations` ({base: (size, handle types)}); every
    other address is cudaMalloc'd memory, legacy IPC capable, unless `unknown`."""

    allocations: dict[int, tuple[int, int]] = field(default_factory=dict)
    unknown: bool = False
    exports: int = 0
    retained: int = 0
    fail_export: bool = False

    def ensure_context(self, device: int) -> None:
        pass

    def _find(self, pointer: int) -> int | None:
        return next((b for b, (s, _) in self.allocations.items() if b <= pointer < b + s), None)

    def pointer_attribute(self, attribute: int, pointer: int) -> int | None:
        base = self._find(pointer)
        if attribute == cd.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
            return int(base is None and not self.unknown)
        if base is None:
            return None
        size, types = self.allocations[base]
        return {cd.CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR: base,
                cd.CU_POINTER_ATTRIBUTE_MAPPING_SIZE: size,
                cd.CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: types}.get(attribute)

    def retain_allocation(self, pointer: int) -> int | None:
        base = self._find(pointer)
        if base is None:
            return None
        self.retained += 1
        return base

    def release(self, handle: int) -> None:
        self.retained -= 1

    def export_fd(self, handle: int) -> int:
        if self.fail_export:
            raise cd.CudaDriverError("cuMemExportToShareableHandle", 1,
                                     "CUDA_ERROR_INVALID_VALUE", "invalid argument")
        self.exports += 1
        return os.memfd_create("fake-export")


def storage(pointer: int, nbytes: int) -> Any:
    return SimpleNamespace(device=torch.device("cuda", 0), data_ptr=lambda: pointer,
                           nbytes=lambda: nbytes)


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    fake = FakeDriver()
    monkeypatch.setattr(cuda_vmm_export, "cuda_driver", lambda: fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(uuid="GPU-fake"))
    return fake


def export(driver: FakeDriver, *storages: Any) -> tuple[list[Any], HandoverFiles]:
    files = HandoverFiles()
    exported: dict[int, tuple[int, int]] = {}
    try:
        return [cuda_vmm_export.export_driver_mapped(s, files, exported)
                for s in storages], files
    finally:
        assert driver.retained == 0, "a retained allocation handle was not released"


def test_cudamalloc_memory_keeps_cuda_ipc(driver: FakeDriver) -> None:
    handles, files = export(driver, storage(0x7000_0000, 4096))
    assert handles == [None] and files.fds == []
    driver.unknown = True  # neither IPC capable nor driver-mapped: IPC says why not
    assert export(driver, storage(0x7000_0000, 4096))[0] == [None]


def test_one_descriptor_per_allocation_with_each_storages_place_in_it(
        driver: FakeDriver) -> None:
    driver.allocations = {0x1000_0000: (GRANULE, 1), 0x1020_0000: (GRANULE, 1)}
    handles, files = export(driver, storage(0x1000_0000, 1 << 20),
                            storage(0x1000_0000 + (1 << 20), 1 << 19),
                            storage(0x1020_0000, GRANULE))
    try:
        assert driver.exports == 2 and len(files.fds) == 2 == len(files.owned)
        assert [(h.fd_index, h.allocation_bytes, h.offset, h.nbytes) for h in handles] == [
            (0, GRANULE, 0, 1 << 20), (0, GRANULE, 1 << 20, 1 << 19), (1, GRANULE, 0, GRANULE)]
        assert {h.device_uuid for h in handles} == {"GPU-fake"}
    finally:
        files.close()


def test_memory_without_an_exportable_handle_type_is_refused_naming_sleep_mode(
        driver: FakeDriver) -> None:
    driver.allocations = {0x1000_0000: (GRANULE, cd.CU_MEM_HANDLE_TYPE_NONE)}
    with pytest.raises(InvalidRequest, match=r"without an exportable handle type.*sleep mode"):
        export(driver, storage(0x1000_0000, GRANULE))
    assert driver.exports == 0
    # A driver that does not report the handle types: the export's failure says the same.
    driver.allocations = {0x1000_0000: (GRANULE, None)}  # type: ignore[dict-item]
    driver.fail_export = True
    with pytest.raises(InvalidRequest, match=r"sleep mode.*CUDA_ERROR_INVALID_VALUE"):
        export(driver, storage(0x1000_0000, GRANULE))


def test_a_storage_over_several_allocations_is_refused(driver: FakeDriver) -> None:
    driver.allocations = {0x1000_0000: (GRANULE, 1), 0x1020_0000: (GRANULE, 1)}
    with pytest.raises(InvalidRequest, match="spans several physical allocations"):
        export(driver, storage(0x1010_0000, GRANULE))
    assert driver.exports == 0


class _FakeLibrary:
    """libcuda's entry points as Python callables: every call succeeds but cuMemMap."""

    def __getattr__(self, name: str) -> Any:
        def fn(*args: Any) -> int:
            if name in ("cuGetErrorName", "cuGetErrorString"):
                args[1]._obj.value = (b"CUDA_ERROR_INVALID_VALUE" if name == "cuGetErrorName"
                                      else b"invalid argument")
            return 1 if name == "cuMemMap" else 0

        setattr(self, name, fn)
        return fn


def test_a_failed_call_names_itself_and_the_drivers_error() -> None:
    driver = cd.CudaDriver(_FakeLibrary())  # type: ignore[arg-type]
    with pytest.raises(cd.CudaDriverError) as caught:
        driver.map(1 << 40, GRANULE, 5)
    assert str(caught.value) == ("cuMemMap failed: CUDA_ERROR_INVALID_VALUE (invalid argument, "
                                 "CUresult 1)")
    assert caught.value.call == "cuMemMap" and caught.value.code == 1


def test_struct_layouts_match_cuda_h() -> None:
    prop = cd.CUmemAllocationProp
    assert ctypes.sizeof(prop) == 32
    assert [getattr(prop, f).offset for f in ("type", "requestedHandleTypes", "location",
                                              "win32HandleMetaData", "allocFlags")] == \
        [0, 4, 8, 16, 24]
    assert ctypes.sizeof(cd.CUmemAccessDesc) == 12
    assert ctypes.sizeof(cd.CUdeviceptr) == ctypes.sizeof(cd.CUmemGenericAllocationHandle) == 8
