"""Driver-mapped (VMM) engine memory: checked in the server, imported and mapped in its
GPU's copy process.

An engine whose KV cache was made with cuMemCreate (vLLM 0.34's extensible KV cache)
exports each physical allocation as a POSIX file descriptor (`kvdepot.client.cuda_vmm_export`)
and hands it over with its other descriptors. The server checks what it can without the
GPU (`check_vmm_descriptor`: the size claims, and that the descriptor is no file, socket
or pipe) and passes the descriptor to the copy process with the registration's `Open`.
The copy process imports it (cuMemImportFromShareableHandle, which is what finally tells
an export from anything else), maps exactly the claimed bytes into an address range of
its own (cuMemMap fails when they exceed the allocation) with read-write access for its
GPU, and closes the descriptor. From there the copies run as over IPC-opened memory: the
mapped range is a torch tensor (`raw_byte_view`). Closing waits for the copies in flight,
then unmaps and frees the range; the driver frees the memory once neither the engine nor
any importer maps or holds it, so an engine that dies mid-copy leaves its memory valid
until the copy process lets go.
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat

import torch

from kvdepot.errors import InvalidRequest, ServerError
from kvdepot.protocol import CudaVMMMemory
from kvdepot.transfer.address_span import raw_byte_view
from kvdepot.transfer.cuda_copier import CudaCopier
from kvdepot.transfer.cuda_driver import CudaDriverError, cuda_driver

log = logging.getLogger(__name__)

_ANON_INODE_FS = 0x09041934
"""statfs f_type of anon_inodefs: kernels that give anonymous inodes a regular-file mode
must not have them taken for files."""


def _filesystem_type(fd: int) -> int | None:
    buf = ctypes.create_string_buffer(128)  # struct statfs; f_type is its first field
    if ctypes.CDLL(None, use_errno=True).fstatfs(fd, buf) != 0:
        return None
    return int.from_bytes(buf.raw[:ctypes.sizeof(ctypes.c_long)], "little", signed=True)


def check_vmm_handle(handle: CudaVMMMemory) -> None:
    """Refuse size claims that cannot describe a storage inside one allocation."""
    if handle.allocation_bytes <= 0 or handle.nbytes <= 0:
        raise InvalidRequest("a driver-mapped CUDA allocation claims no bytes")
    if handle.offset + handle.nbytes > handle.allocation_bytes:
        raise InvalidRequest(
            f"a driver-mapped CUDA storage claims bytes [{handle.offset}, "
            f"{handle.offset + handle.nbytes}) of an allocation of {handle.allocation_bytes}")


def check_vmm_descriptor(fd: int) -> None:
    """Refuse a descriptor that is plainly no CUDA memory export: a socket, a pipe, a
    directory, or a file (a memfd or one on disk). What is left, the driver judges when
    the copy process imports it."""
    mode = os.fstat(fd).st_mode
    kind = ("a socket" if stat.S_ISSOCK(mode) else "a pipe" if stat.S_ISFIFO(mode)
            else "a directory" if stat.S_ISDIR(mode) else None)
    if kind is None and stat.S_ISREG(mode) and _filesystem_type(fd) != _ANON_INODE_FS:
        kind = "a file"
    if kind is not None:
        raise InvalidRequest(f"a handed-over driver-mapped CUDA memory descriptor is {kind}, "
                             "not an export of CUDA memory (cuMemExportToShareableHandle)")


class VMMMapping:
    """One imported allocation, mapped read-write for one GPU of this process."""

    def __init__(self, fd: int, nbytes: int, device: int) -> None:
        """Import `fd` (the caller closes it) and map its first `nbytes`; on any failure
        nothing stays imported, reserved or mapped."""
        self.device = device
        self.nbytes = nbytes
        self.pointer = 0
        driver = cuda_driver()
        driver.ensure_context(device)
        granularity = driver.granularity(device)
        if nbytes <= 0 or nbytes % granularity:
            raise InvalidRequest(f"a driver-mapped CUDA allocation of {nbytes} bytes is not a "
                                 f"whole number of the GPU's {granularity}-byte granules")
        try:
            handle = driver.import_fd(fd)
        except CudaDriverError as exc:
            raise InvalidRequest(f"the handed-over descriptor is not exported CUDA memory this "
                                 f"GPU can import: {exc}") from None
        try:
            pointer = driver.reserve(nbytes, granularity)
            try:
                try:
                    driver.map_accessible(pointer, nbytes, handle, device)
                except CudaDriverError as exc:
                    if exc.call != "cuMemMap":  # the access grant: not the engine's doing
                        raise
                    raise InvalidRequest(
                        f"cannot map {nbytes} bytes of the engine's driver-mapped CUDA "
                        f"allocation ({exc}): the allocation is smaller than the "
                        "registration claims, or not device memory") from None
            except BaseException:
                driver.free_address(pointer, nbytes)
                raise
        finally:
            # The mapping holds the memory from here; the handle is not needed again.
            driver.release(handle)
        self.pointer = pointer

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of the mapping as a uint8 tensor on its GPU;
        valid until `close`."""
        if self.pointer == 0 or offset < 0 or nbytes <= 0 or offset + nbytes > self.nbytes:
            raise InvalidRequest(f"bytes [{offset}, {offset + nbytes}) lie outside a "
                                 f"{self.nbytes}-byte driver-mapped allocation")
        with torch.cuda.device(self.device):
            view = raw_byte_view(self.pointer + offset, nbytes,
                                 torch.device("cuda", self.device))
        # as_tensor copies where it takes the memory for another device's: copies into
        # such a tensor would never reach the engine.
        if view.data_ptr() != self.pointer + offset or view.untyped_storage().nbytes() != nbytes:
            raise ServerError(f"torch did not wrap the mapped allocation in place (cuda:"
                              f"{self.device}, got a tensor on {view.device})")
        return view

    def close(self) -> None:
        """Unmap and free the address range (once; every copy using it must be done)."""
        pointer, self.pointer = self.pointer, 0
        if pointer:
            driver = cuda_driver()
            driver.unmap(pointer, self.nbytes)
            driver.free_address(pointer, self.nbytes)


def map_vmm_allocations(handles: list[CudaVMMMemory], fds: dict[int, int], device: int
                        ) -> dict[int, VMMMapping]:
    """Each distinct allocation `handles` name (by `fd_index`, whose descriptor `fds`
    holds), mapped once on GPU `device`; all or none."""
    mappings: dict[int, VMMMapping] = {}
    try:
        for handle in handles:
            check_vmm_handle(handle)
            known = mappings.get(handle.fd_index)
            if known is not None:
                if known.nbytes != handle.allocation_bytes:
                    raise InvalidRequest(f"descriptor {handle.fd_index} is claimed as "
                                         f"allocations of {known.nbytes} and "
                                         f"{handle.allocation_bytes} bytes")
                continue
            fd = fds.get(handle.fd_index)
            if fd is None:
                raise InvalidRequest(f"no descriptor was handed over for driver-mapped "
                                     f"allocation {handle.fd_index}")
            mappings[handle.fd_index] = VMMMapping(fd, handle.allocation_bytes, device)
    except BaseException:
        for mapping in mappings.values():
            mapping.close()
        raise
    return mappings


class MappedCudaCopier(CudaCopier):
    """A `CudaCopier` over driver-mapped allocations too, which it unmaps once its copies
    in flight are done."""

    def __init__(self, device: torch.device, allocations: list[torch.Tensor],
                 storages: list[torch.UntypedStorage], mappings: list[VMMMapping]) -> None:
        super().__init__(device, allocations, storages)
        self._mappings = mappings

    def close(self) -> None:
        super().close()  # waits for the copies, drops every tensor over the mappings
        mappings, self._mappings = self._mappings, []
        for mapping in mappings:
            mapping.close()
