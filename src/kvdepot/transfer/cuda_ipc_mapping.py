"""Check an engine's CUDA KV cache (in the server) and map it through CUDA IPC (in its
GPU's copy process), or, for driver-mapped memory, through `cuda_vmm_mapping`.

The engine (`kvdepot.client.kv_export`) exports each distinct allocation with torch's
storage sharing; the server checks the handles (`checked_device`) and its GPU's copy
process opens each allocation once with the matching torch call (`open_copier`), which
also takes part in torch's cross-process reference counting so the engine's caching
allocator keeps the memory until the copy process lets go of it. Devices are named by
UUID because the server may run with another CUDA_VISIBLE_DEVICES than the engine (its
copy processes see the server's).
"""

from __future__ import annotations

import logging
import os
import re
import stat

import torch

from kvdepot.errors import InvalidRequest
from kvdepot.protocol import CudaIPCMemory, CudaVMMMemory
from kvdepot.transfer.cuda_copier import CudaCopier
from kvdepot.transfer.cuda_vmm_mapping import (
    MappedCudaCopier,
    check_vmm_handle,
    map_vmm_allocations,
)

log = logging.getLogger(__name__)


def device_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid`."""
    if not torch.cuda.is_available():
        raise InvalidRequest("the engine registered CUDA memory, but this kvdepot server sees "
                             "no CUDA device; run it on the engine's machine with GPU access")
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise InvalidRequest(f"the engine's GPU {uuid} is not visible to the kvdepot server; "
                         "check the server's CUDA_VISIBLE_DEVICES")


def _open(handle: CudaIPCMemory, device: int) -> torch.UntypedStorage:
    try:
        return torch.UntypedStorage._new_shared_cuda(
            device, handle.handle, handle.nbytes, handle.offset, handle.ref_counter_handle,
            handle.ref_counter_offset, handle.event_handle, handle.event_sync_required)
    except RuntimeError as exc:
        raise InvalidRequest(f"cannot map the engine's CUDA memory ({handle.nbytes} bytes on "
                             f"GPU {handle.device_uuid}): {exc}") from exc


REF_COUNTER_SLOTS = 10000
"""int64 counters in one of torch's CUDA IPC reference-counter files (torch's
CUDA_IPC_REF_COUNTER_FILE_SIZE)."""
_SHM_DIR = "/dev/shm"


def check_ref_counter(handle: CudaIPCMemory, pid: int, uid: int) -> None:
    """Refuse a reference counter that is not the registering process's own.

    When the copy process lets go of the memory, torch opens the counter file by the name
    the client sent (shm_open, with the server's rights: the copy process is the
    server's child) and decrements the counter at the offset the client sent, unchecked.
    So the name must be one torch gave a file of the process that handed over
    (`/torch_<its pid>_...`), the file must be a regular one that process's user owns,
    and the offset must lie inside it.
    """
    name = handle.ref_counter_handle.decode("ascii", errors="replace")
    match = re.fullmatch(r"/torch_(\d+)_\d+_\d+", name)
    if match is None or int(match.group(1)) != pid:
        raise InvalidRequest("a CUDA allocation's reference counter is not a torch counter of "
                             f"the registering process (pid {pid})")
    if not 0 <= handle.ref_counter_offset < REF_COUNTER_SLOTS:
        raise InvalidRequest(f"ref_counter_offset {handle.ref_counter_offset} is outside "
                             f"torch's {REF_COUNTER_SLOTS} counters")
    try:
        info = os.lstat(_SHM_DIR + name)  # shm_open never follows a link either
    except OSError:
        raise InvalidRequest("a CUDA allocation's reference counter file does not exist") from None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
        raise InvalidRequest("a CUDA allocation's reference counter file is not the "
                             "registering user's")


def checked_device(handles: list[CudaIPCMemory | CudaVMMMemory], pid: int, uid: int) -> int:
    """This process's index of the one GPU all `handles` live on, once every IPC
    reference counter is the registering process's own (`pid` and `uid` as the kernel
    reported them) and every driver-mapped allocation's size claims hold together."""
    for handle in handles:
        if isinstance(handle, CudaVMMMemory):
            check_vmm_handle(handle)
        else:
            check_ref_counter(handle, pid, uid)
    uuids = {h.device_uuid for h in handles}
    if len(uuids) != 1:
        raise InvalidRequest(f"one worker's KV cache must live on one GPU, got {sorted(uuids)}")
    uuid = uuids.pop()
    index = device_index(uuid)
    # Said once per registration, so an operator (and the multi-GPU test) can see which
    # of this process's devices the engine's GPU turned out to be.
    log.info("engine KV cache on GPU %s: this server's cuda:%d", uuid, index)
    return index


def open_copier(handles: list[CudaIPCMemory | CudaVMMMemory], index: int,
                fds: dict[int, int] | None = None) -> CudaCopier:
    """Open every allocation once, on GPU `index`, into a copier that owns the mappings:
    closing it releases them, after any copy still running has finished. Driver-mapped
    allocations are imported from `fds` (handover index to descriptor; the caller
    closes them)."""
    device = torch.device("cuda", index)
    opened: dict[tuple[bytes, int, int], torch.UntypedStorage] = {}
    storages: list[torch.UntypedStorage] = []
    torch.cuda.init()
    vmm = [h for h in handles if isinstance(h, CudaVMMMemory)]
    with torch.cuda.device(index):
        mappings = map_vmm_allocations(vmm, fds or {}, index) if vmm else {}
        try:
            for handle in handles:
                if isinstance(handle, CudaVMMMemory):
                    view = mappings[handle.fd_index].tensor(handle.offset, handle.nbytes)
                    storages.append(view.untyped_storage())
                    continue
                key = (handle.handle, handle.offset, handle.nbytes)
                if key not in opened:
                    opened[key] = _open(handle, index)
                storages.append(opened[key])
            tensors = [torch.empty(0, dtype=torch.uint8, device=device).set_(s)
                       for s in storages]
            if not mappings:
                return CudaCopier(device, tensors, list(opened.values()))
            return MappedCudaCopier(device, tensors, [*opened.values(), *storages],
                                    list(mappings.values()))
        except BaseException:
            storages.clear()
            opened.clear()
            for mapping in mappings.values():
                mapping.close()
            raise
