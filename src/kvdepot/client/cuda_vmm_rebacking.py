"""Put exportable physical memory behind driver-mapped KV memory that has none.

An allocator that reserves an address range and maps one physical allocation into it
(cuMemCreate) decides at creation which handle types the allocation can be exported as.
vLLM's sleep-mode allocator before 0.34 asks for none, so neither CUDA IPC nor a POSIX
descriptor can carry its KV cache to the server. The range itself is only an address: the
engine keeps its pointer (and every tensor on it) while the physical memory behind it is
swapped for an allocation made exportable as POSIX descriptors, which the worker then
exports like vLLM 0.34's (`cuda_vmm_export`).
"""

from __future__ import annotations

from kvdepot.transfer.cuda_driver import CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, cuda_driver


def map_exportable(pointer: int, nbytes: int, device: int) -> int:
    """Create an exportable allocation of `nbytes` on `device` and map it, readable and
    writable, at the reserved, unmapped range at `pointer`; returns its handle (the
    caller releases it after unmapping)."""
    driver = cuda_driver()
    driver.ensure_context(device)
    handle = driver.create(nbytes, device, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    try:
        driver.map_accessible(pointer, nbytes, handle, device)
    except BaseException:
        driver.release(handle)
        raise
    return handle


def back_with_exportable(pointer: int, nbytes: int, device: int, handle: int) -> int:
    """Move the range at `pointer`, mapped to the one allocation `handle`, onto a new
    exportable allocation with the same contents at the same address; release `handle`
    and return the new one.

    Nothing may use the range meanwhile: the caller has synchronized the device. Should
    the move fail before the old memory is unmapped, the range is left as it was."""
    driver = cuda_driver()
    driver.ensure_context(device)
    # The copy goes through a second range: source and target need addresses at once.
    spare = driver.reserve(nbytes, 0)
    try:
        new = map_exportable(spare, nbytes, device)
        try:
            driver.copy(spare, pointer, nbytes)
        except BaseException:
            driver.unmap(spare, nbytes)
            driver.release(new)
            raise
        driver.unmap(spare, nbytes)  # the allocation lives on through its handle
    finally:
        driver.free_address(spare, nbytes)
    try:
        driver.unmap(pointer, nbytes)
    except BaseException:
        driver.release(new)
        raise
    try:
        driver.map_accessible(pointer, nbytes, new, device)
    except BaseException:
        # Put the old memory back: the engine's tensors still point here.
        driver.map_accessible(pointer, nbytes, handle, device)
        driver.release(new)
        raise
    driver.release(handle)
    return new
