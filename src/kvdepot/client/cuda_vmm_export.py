"""Export driver-mapped CUDA KV memory (cuMemCreate) to the server as POSIX descriptors.

vLLM 0.34's extensible KV cache is a reserved address range with one physical allocation
per segment, made exportable as POSIX file descriptors when the connector asks for it
(`KVCacheAccess.EXPORTS_FD`); cudaIpcGetMemHandle cannot export such memory. For each
distinct storage the worker asks the driver what the memory is: cudaMalloc'd memory
(legacy IPC capable) keeps the IPC path; driver-mapped memory is exported here, one
descriptor per physical allocation, handed over with the registration's other
descriptors. A storage must lie inside one allocation: vLLM backs each segment with one
when a connector exports it, and the server maps each allocation on its own.

Memory made by cuMemCreate without an exportable handle type (vLLM's sleep-mode
CuMemAllocator before 0.34) can be shared neither way: it is refused with the reason, so
the connector runs the engine without kvdepot instead of failing it.
"""

from __future__ import annotations

import torch

from kvdepot.client.memory_handover import HandoverFiles
from kvdepot.errors import InvalidRequest
from kvdepot.protocol import CudaVMMMemory
from kvdepot.transfer.cuda_driver import (
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
    CU_POINTER_ATTRIBUTE_MAPPING_SIZE,
    CudaDriverError,
    cuda_driver,
)

NOT_EXPORTABLE = (
    "is driver-mapped (cuMemCreate) without an exportable handle type, as vLLM's sleep "
    "mode allocates it (CuMemAllocator, enable_sleep_mode=True, before vLLM 0.34): "
    "neither CUDA IPC nor a POSIX file descriptor can share it with the kvdepot server. "
    "Run this engine without sleep mode to use kvdepot, or without kvdepot")


def export_driver_mapped(storage: torch.UntypedStorage, files: HandoverFiles,
                         exported: dict[int, tuple[int, int]]) -> CudaVMMMemory | None:
    """The handle of `storage` if the driver maps its memory (its allocation's descriptor
    added to `files`, once per allocation: `exported` maps each exported allocation's
    base address to its descriptor index and size); None for cudaMalloc'd memory, which
    goes through CUDA IPC."""
    assert storage.device.type == "cuda"
    device = storage.device.index if storage.device.index is not None else 0
    pointer, nbytes = storage.data_ptr(), storage.nbytes()
    where = f"the KV cache storage at {pointer:#x} ({nbytes} bytes on cuda:{device})"
    driver = cuda_driver()
    driver.ensure_context(device)
    if driver.pointer_attribute(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, pointer):
        return None
    handle = driver.retain_allocation(pointer)
    if handle is None:
        # Neither cudaMalloc'd nor driver-mapped (stream-ordered pool memory, say): the
        # IPC path reports why it cannot share it.
        return None
    try:
        base = driver.pointer_attribute(CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, pointer)
        size = driver.pointer_attribute(CU_POINTER_ATTRIBUTE_MAPPING_SIZE, pointer)
        if not base or not size:
            raise InvalidRequest(f"{where} is driver-mapped, but this CUDA driver does not "
                                 "report its allocation's extent (CUDA 12 drivers do)")
        if nbytes <= 0 or pointer + nbytes > base + size:
            raise InvalidRequest(
                f"{where} spans several physical allocations (the one at its start holds "
                f"{base + size - pointer} of its bytes): kvdepot maps each storage from one "
                "allocation, as vLLM backs each KV cache segment when a connector exports it")
        types = driver.pointer_attribute(CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, pointer)
        if types is not None and not types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
            raise InvalidRequest(f"{where} {NOT_EXPORTABLE}")
        known = exported.get(base)
        if known is None:
            try:
                fd = driver.export_fd(handle)
            except CudaDriverError as exc:
                raise InvalidRequest(f"{where} {NOT_EXPORTABLE} ({exc})") from None
            known = (files.add(fd, size, owned=True).fd_index, size)
            exported[base] = known
    finally:
        driver.release(handle)  # what cuMemRetainAllocationHandle took
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return CudaVMMMemory(device_uuid=uuid, fd_index=known[0], allocation_bytes=known[1],
                         offset=pointer - base, nbytes=nbytes)
