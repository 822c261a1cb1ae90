"""The few CUDA driver calls kvdepot makes itself, through ctypes: the virtual memory
management (VMM) API that driver-mapped KV memory is exported and imported with, and the
batched copy (`cuMemcpyBatchAsync`) that stores short segments without a kernel.

torch reaches neither from Python, so the worker (export) and the copy process (import,
map, batched copies) call libcuda directly. Every call's CUresult is checked and a failure
raised as `CudaDriverError`, naming the call and the driver's own name and description of
the error. libcuda is the one the process has loaded already (torch's), found by name.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_SUPPORTED = 801

CU_MEM_HANDLE_TYPE_NONE = 0
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1

# CUpointer_attribute values (cuda.h).
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_POINTER_ATTRIBUTE_MAPPED = 13
CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 14
CU_POINTER_ATTRIBUTE_MAPPING_SIZE = 18
CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR = 19

CUdeviceptr = ctypes.c_ulonglong
CUmemGenericAllocationHandle = ctypes.c_ulonglong


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    """cuda.h's CUmemAllocationProp (32 bytes on x86-64)."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", CUmemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", CUmemAllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    """cuda.h's CUmemcpyAttributes (24 bytes): how the copies of a batch access memory."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", CUmemLocation),
                ("dstLocHint", CUmemLocation), ("flags", ctypes.c_uint)]


class CudaDriverError(RuntimeError):
    """A driver call failed: `call` names it, `code` is its CUresult."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        super().__init__(f"{call} failed: {name} ({text}, CUresult {code})")
        self.call = call
        self.code = code
        self.name = name


_P = ctypes.POINTER
_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorString": [ctypes.c_int, _P(ctypes.c_char_p)],
    "cuGetErrorName": [ctypes.c_int, _P(ctypes.c_char_p)],
    "cuDeviceGet": [_P(ctypes.c_int), ctypes.c_int],
    "cuCtxGetCurrent": [_P(ctypes.c_void_p)],
    "cuCtxSetCurrent": [ctypes.c_void_p],
    "cuDevicePrimaryCtxRetain": [_P(ctypes.c_void_p), ctypes.c_int],
    "cuPointerGetAttribute": [ctypes.c_void_p, ctypes.c_int, CUdeviceptr],
    "cuMemRetainAllocationHandle": [_P(CUmemGenericAllocationHandle), ctypes.c_void_p],
    "cuMemGetAllocationPropertiesFromHandle": [_P(CUmemAllocationProp),
                                               CUmemGenericAllocationHandle],
    "cuMemExportToShareableHandle": [ctypes.c_void_p, CUmemGenericAllocationHandle,
                                     ctypes.c_int, ctypes.c_ulonglong],
    "cuMemImportFromShareableHandle": [_P(CUmemGenericAllocationHandle), ctypes.c_void_p,
                                       ctypes.c_int],
    "cuMemGetAllocationGranularity": [_P(ctypes.c_size_t), _P(CUmemAllocationProp),
                                      ctypes.c_int],
    "cuMemCreate": [_P(CUmemGenericAllocationHandle), ctypes.c_size_t,
                    _P(CUmemAllocationProp), ctypes.c_ulonglong],
    "cuMemAddressReserve": [_P(CUdeviceptr), ctypes.c_size_t, ctypes.c_size_t, CUdeviceptr,
                            ctypes.c_ulonglong],
    "cuMemAddressFree": [CUdeviceptr, ctypes.c_size_t],
    "cuMemMap": [CUdeviceptr, ctypes.c_size_t, ctypes.c_size_t, CUmemGenericAllocationHandle,
                 ctypes.c_ulonglong],
    "cuMemSetAccess": [CUdeviceptr, ctypes.c_size_t, _P(CUmemAccessDesc), ctypes.c_size_t],
    "cuMemUnmap": [CUdeviceptr, ctypes.c_size_t],
    "cuMemRelease": [CUmemGenericAllocationHandle],
    "cuMemcpyDtoD_v2": [CUdeviceptr, CUdeviceptr, ctypes.c_size_t],
    "cuCtxSynchronize": [],
}
"""Every call's argument types, from cuda.h: device pointers and allocation handles are
unsigned long long; a POSIX descriptor goes to cuMemImportFromShareableHandle as the
pointer-sized integer itself, and comes back from cuMemExportToShareableHandle as an int
written where its first argument points."""
_BATCH_COPY = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
               _P(CUmemcpyAttributes), _P(ctypes.c_size_t), ctypes.c_size_t]
_BATCH_COPY_CALLS = {"cuMemcpyBatchAsync_v2": [*_BATCH_COPY, ctypes.c_void_p],
                     "cuMemcpyBatchAsync": [*_BATCH_COPY, _P(ctypes.c_size_t), ctypes.c_void_p]}
"""The batched copy, newest first: CUDA 13's `_v2` (dsts, srcs, sizes, count, attrs,
attrsIdxs, numAttrs, stream) dropped the failure index that CUDA 12.8's call takes before
the stream. A driver older than 12.8 has neither."""


class CudaDriver:
    """libcuda's VMM and batched-copy calls, each raising `CudaDriverError` when it fails."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        self._fns: dict[str, Any] = {}
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(library, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            self._fns[name] = fn
        self._batch_copy: tuple[str, Any] | None = None
        for name, argtypes in _BATCH_COPY_CALLS.items():
            fn = getattr(library, name, None)
            if fn is not None:
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
                self._batch_copy = (name, fn)
                break
        self.call("cuInit", 0)

    def error_text(self, code: int) -> tuple[str, str]:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self._fns["cuGetErrorName"](code, ctypes.byref(name))
        self._fns["cuGetErrorString"](code, ctypes.byref(text))
        return ((name.value or b"CUDA_ERROR_UNKNOWN").decode(),
                (text.value or b"unknown error").decode())

    def call(self, name: str, *args: Any) -> None:
        code = int(self._fns[name](*args))
        if code != CUDA_SUCCESS:
            raise CudaDriverError(name, code, *self.error_text(code))

    def try_call(self, name: str, *args: Any) -> int:
        """The CUresult, unchecked: for calls whose failure is an answer (is this memory
        driver-mapped?), not an error."""
        return int(self._fns[name](*args))

    # ---- contexts -------------------------------------------------------------------
    def ensure_context(self, device: int) -> None:
        """Make a context current on this thread if none is: the device's primary one,
        which torch uses too. Driver calls need one; torch makes it current only on the
        threads that have run CUDA work."""
        current = ctypes.c_void_p()
        self.call("cuCtxGetCurrent", ctypes.byref(current))
        if current.value:
            return
        ordinal = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(ordinal), device)
        context = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(context), ordinal.value)
        self.call("cuCtxSetCurrent", context)

    # ---- pointers -------------------------------------------------------------------
    def pointer_attribute(self, attribute: int, pointer: int) -> int | None:
        """An integer attribute of a device pointer; None where the driver does not say
        (an attribute older drivers lack, or a pointer it does not know)."""
        value = ctypes.c_ulonglong(0)  # the widest result (a pointer, a size); zeroed
        code = self.try_call("cuPointerGetAttribute", ctypes.byref(value), attribute,
                             CUdeviceptr(pointer))
        return value.value if code == CUDA_SUCCESS else None

    # ---- allocations ----------------------------------------------------------------
    def retain_allocation(self, pointer: int) -> int | None:
        """The allocation handle of driver-mapped memory at `pointer` (release it), or
        None: the memory is not driver-mapped (cudaMalloc's, say)."""
        handle = CUmemGenericAllocationHandle()
        code = self.try_call("cuMemRetainAllocationHandle", ctypes.byref(handle),
                             ctypes.c_void_p(pointer))
        return handle.value if code == CUDA_SUCCESS else None

    def allocation_properties(self, handle: int) -> CUmemAllocationProp:
        prop = CUmemAllocationProp()
        self.call("cuMemGetAllocationPropertiesFromHandle", ctypes.byref(prop),
                  CUmemGenericAllocationHandle(handle))
        return prop

    def export_fd(self, handle: int) -> int:
        fd = ctypes.c_int(-1)
        self.call("cuMemExportToShareableHandle", ctypes.byref(fd),
                  CUmemGenericAllocationHandle(handle), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                  0)
        return fd.value

    def import_fd(self, fd: int) -> int:
        handle = CUmemGenericAllocationHandle()
        self.call("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd),
                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return handle.value

    def device_prop(self, device: int, handle_types: int) -> CUmemAllocationProp:
        prop = CUmemAllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = handle_types
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        return prop

    def granularity(self, device: int) -> int:
        size = ctypes.c_size_t()
        prop = self.device_prop(device, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        self.call("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(prop),
                  CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        return size.value

    def create(self, nbytes: int, device: int, handle_types: int) -> int:
        handle = CUmemGenericAllocationHandle()
        prop = self.device_prop(device, handle_types)
        self.call("cuMemCreate", ctypes.byref(handle), nbytes, ctypes.byref(prop), 0)
        return handle.value

    def release(self, handle: int) -> None:
        self.call("cuMemRelease", CUmemGenericAllocationHandle(handle))

    # ---- address ranges -------------------------------------------------------------
    def reserve(self, nbytes: int, alignment: int) -> int:
        pointer = CUdeviceptr()
        self.call("cuMemAddressReserve", ctypes.byref(pointer), nbytes, alignment,
                  CUdeviceptr(0), 0)
        return pointer.value

    def free_address(self, pointer: int, nbytes: int) -> None:
        self.call("cuMemAddressFree", CUdeviceptr(pointer), nbytes)

    def map(self, pointer: int, nbytes: int, handle: int) -> None:
        self.call("cuMemMap", CUdeviceptr(pointer), nbytes, 0,
                  CUmemGenericAllocationHandle(handle), 0)

    def unmap(self, pointer: int, nbytes: int) -> None:
        self.call("cuMemUnmap", CUdeviceptr(pointer), nbytes)

    def set_access(self, pointer: int, nbytes: int, device: int) -> None:
        desc = CUmemAccessDesc()
        desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device
        desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.call("cuMemSetAccess", CUdeviceptr(pointer), nbytes, ctypes.byref(desc), 1)

    def map_accessible(self, pointer: int, nbytes: int, handle: int, device: int) -> None:
        """Map `handle` at the reserved range at `pointer` and grant `device` read-write
        access to it; should the grant fail, the range is unmapped again. A failure names
        its call (`CudaDriverError.call`: cuMemMap or cuMemSetAccess)."""
        self.map(pointer, nbytes, handle)
        try:
            self.set_access(pointer, nbytes, device)
        except BaseException:
            self.unmap(pointer, nbytes)
            raise

    # ---- copies ---------------------------------------------------------------------
    @property
    def copies_in_batches(self) -> bool:
        """Whether this driver has `cuMemcpyBatchAsync` (CUDA 12.8 on)."""
        return self._batch_copy is not None

    def copy_batch(self, destinations: np.ndarray, sources: np.ndarray, sizes: np.ndarray,
                   stream: int) -> None:
        """Queue `sizes[i]` bytes from `sources[i]` to `destinations[i]`, for every i, on
        `stream` (a `cudaStream_t`) in one call, each source read in stream order. The
        arrays are uint64 (addresses and byte counts) and equally long."""
        if self._batch_copy is None:
            raise CudaDriverError("cuMemcpyBatchAsync", CUDA_ERROR_NOT_SUPPORTED,
                                  "CUDA_ERROR_NOT_SUPPORTED", "this driver is older than 12.8")
        name, fn = self._batch_copy
        arrays = [np.ascontiguousarray(a, dtype=np.uint64)
                  for a in (destinations, sources, sizes)]
        attributes = CUmemcpyAttributes()
        attributes.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        first = ctypes.c_size_t(0)  # the one set of attributes applies from copy 0 on
        args: list[Any] = [*(ctypes.c_void_p(a.ctypes.data) for a in arrays),
                           len(arrays[0]), ctypes.byref(attributes), ctypes.byref(first), 1]
        failed_at = ctypes.c_size_t(0)
        if name == "cuMemcpyBatchAsync":
            args.append(ctypes.byref(failed_at))
        code = int(fn(*args, ctypes.c_void_p(stream)))
        if code != CUDA_SUCCESS:
            raise CudaDriverError(name, code, *self.error_text(code))

    def copy(self, destination: int, source: int, nbytes: int) -> None:
        """Copy device memory to device memory and wait until it is done."""
        self.call("cuMemcpyDtoD_v2", CUdeviceptr(destination), CUdeviceptr(source), nbytes)
        self.call("cuCtxSynchronize")


_driver: CudaDriver | None = None
_driver_lock = threading.Lock()


def cuda_driver() -> CudaDriver:
    """The process's driver bindings, loaded on first use (after torch has initialised
    CUDA, so the libcuda it loaded is the one found)."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                library = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise CudaDriverError("dlopen(libcuda.so.1)", -1, "CUDA_ERROR_NOT_FOUND",
                                      str(exc)) from None
            _driver = CudaDriver(library)
        return _driver
