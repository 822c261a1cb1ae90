"""Describe an engine's KV tensors to the server and share their memory with it.

CPU tensors: the storage moves into a size-sealed memfd in place (`sealed_storage`:
every existing view of it keeps working) and its file descriptor is handed to the server
over the handover socket (`memory_handover`). CUDA tensors: cudaMalloc'd allocations
are exported as CUDA IPC handles, driver-mapped ones (vLLM 0.34's extensible KV cache) as
POSIX descriptors handed over like the memfds (`cuda_vmm_export`); the device is named by
UUID because the server may see devices under other indices.

A CUDA allocation is exported through an alias, a second storage over the same memory,
never through the engine's own storage: torch counts a shared storage as in use by another
process for as long as that storage exists, and the engine's KV cache exists until the
process exits, so torch would print at every exit that the process "has been terminated
before all shared CUDA tensors released". The worker drops the aliases once the server has
acknowledged that it unmapped them (`WorkerClient.shutdown`); each alias keeps the engine's
tensor alive, so the memory cannot be reused while torch still counts it as mapped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from kvdepot.client.cuda_vmm_export import export_driver_mapped
from kvdepot.client.memory_handover import HandoverFiles
from kvdepot.client.sealed_storage import move_into_sealed_memfd
from kvdepot.errors import InvalidRequest
from kvdepot.protocol import CudaIPCMemory, LayerSpec, MemoryHandle, SharedCPUMemory


def infer_block_axis(name: str, tensor: torch.Tensor, block_size: int) -> int:
    """Which dimension indexes blocks, for the layouts vLLM hands connectors.

    FlashAttention-style caches are `[2, num_blocks, block_size, heads, head_dim]` (K/V
    first); every other supported layout puts blocks first: vLLM CPU
    `[num_blocks, heads, block_size, dims]`, FlashInfer `[num_blocks, 2, block_size,
    heads, head_dim]`, MLA `[num_blocks, block_size, dim]`.
    """
    shape = tuple(tensor.shape)
    axis = 1 if len(shape) == 5 and shape[0] == 2 and shape[1] != 2 else 0
    if block_size not in shape[axis + 1:]:
        raise InvalidRequest(
            f"cannot tell how KV layer {name!r} of shape {list(shape)} is laid out: no dimension "
            f"after the block dimension {axis} has the block size {block_size}")
    return axis


def _share_cpu(storage: torch.UntypedStorage, files: HandoverFiles) -> SharedCPUMemory:
    fd, nbytes = move_into_sealed_memfd(storage)
    return files.add(fd, nbytes, owned=True)


def _alias(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A new storage over `storage`'s memory that holds a reference to it (through DLPack,
    which wraps the memory in a storage of its own)."""
    whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    return from_dlpack(to_dlpack(whole)).untyped_storage()


def _share_cuda(storage: torch.UntypedStorage) -> tuple[CudaIPCMemory, torch.UntypedStorage]:
    alias = _alias(storage)
    (device, handle, nbytes, offset, ref_handle, ref_offset, event_handle,
     event_sync) = alias._share_cuda_()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return CudaIPCMemory(device_uuid=uuid, handle=handle, offset=offset, nbytes=nbytes,
                         ref_counter_handle=ref_handle, ref_counter_offset=ref_offset,
                         event_handle=event_handle or b"",
                         event_sync_required=event_sync), alias


GROUP_HINT = "per_layer_kv_cache_group_id"
BLOCK_SIZE_HINT = "per_layer_logical_block_size"
STATE_HINT = "per_layer_recurrent_state"
"""kvdepot's own hint (vLLM sends none like it): which layers hold recurrent states
(`LayerSpec.state`), a list of booleans in `kv_caches` order."""


def layer_states(kv_caches: dict[str, torch.Tensor], hints: dict[str, Any] | None
                 ) -> list[bool]:
    """Which layers (in `kv_caches` order) hold recurrent states; none without the hint."""
    states = (hints or {}).get(STATE_HINT)
    if states is None:
        return [False] * len(kv_caches)
    if len(states) != len(kv_caches):
        raise InvalidRequest(f"{STATE_HINT} has {len(states)} entries for {len(kv_caches)} "
                             "KV cache layers")
    return [bool(s) for s in states]


def layer_groups(kv_caches: dict[str, torch.Tensor], block_size: int,
                 hints: dict[str, Any] | None) -> list[int]:
    """Each layer's KV cache group (in `kv_caches` order) from an engine's layout hints;
    all 0 without them. Groups must share the worker's block size."""
    hints = hints or {}
    count = len(kv_caches)
    sizes = hints.get(BLOCK_SIZE_HINT)
    if sizes is not None:
        if len(sizes) != count:
            raise InvalidRequest(f"{BLOCK_SIZE_HINT} has {len(sizes)} entries for {count} "
                                 "KV cache layers")
        other = sorted({int(s) for s in sizes} - {block_size})
        if other:
            raise InvalidRequest(f"KV cache layers with block sizes {other} besides the "
                                 f"engine's {block_size}: kvdepot needs every KV cache group "
                                 "to use one block size")
    groups = hints.get(GROUP_HINT)
    if groups is None:
        return [0] * count
    if len(groups) != count:
        raise InvalidRequest(f"{GROUP_HINT} has {len(groups)} entries for {count} KV cache "
                             "layers")
    numbers = [int(g) for g in groups]
    if any(g < 0 for g in numbers):
        names = [n for n, g in zip(kv_caches, numbers, strict=True) if g < 0]
        raise InvalidRequest(f"KV cache layers {names[:4]} belong to no KV cache group")
    # Renumbered densely, in the engine's order: the server wants 0, 1, ...
    dense = {g: i for i, g in enumerate(sorted(set(numbers)))}
    return [dense[g] for g in numbers]


def describe_kv_caches(kv_caches: dict[str, torch.Tensor], block_size: int,
                       groups: list[int] | None = None, states: list[bool] | None = None
                       ) -> tuple[list[torch.UntypedStorage], list[LayerSpec]]:
    """The distinct allocations under the layers, and one LayerSpec per layer name
    (its `allocation` indexes the first list; `groups`, in `kv_caches` order, gives each
    layer's KV cache group, all 0 by default; `states`, which layers hold recurrent
    states: vLLM lays every one out blocks first, one state per block)."""
    if not kv_caches:
        raise InvalidRequest("register_kv_caches got no KV cache tensors")
    storages: list[torch.UntypedStorage] = []
    by_storage: dict[tuple[str, int], int] = {}
    layers: list[LayerSpec] = []
    group_of = groups or [0] * len(kv_caches)
    state_of = states or [False] * len(kv_caches)
    for (name, tensor), group, state in zip(kv_caches.items(), group_of, state_of,
                                            strict=True):
        if not isinstance(tensor, torch.Tensor):
            raise InvalidRequest(f"KV layer {name!r} is a {type(tensor).__name__}, not one "
                                 "tensor (a recurrent layer's states as separate tensors): "
                                 "kvdepot registers one view per layer")
        if tensor.device.type not in ("cpu", "cuda"):
            raise InvalidRequest(f"KV layer {name!r} is on {tensor.device}; kvdepot shares "
                                 "CPU and CUDA memory only")
        storage = tensor.untyped_storage()
        ident = (str(tensor.device), storage.data_ptr())
        if ident not in by_storage:
            by_storage[ident] = len(storages)
            storages.append(storage)
        layers.append(LayerSpec(
            name=name,
            allocation=by_storage[ident],
            dtype=str(tensor.dtype).removeprefix("torch."),
            shape=list(tensor.shape),
            strides=list(tensor.stride()),
            storage_offset=tensor.storage_offset(),
            block_axis=0 if state else infer_block_axis(name, tensor, block_size),
            group=group,
            state=state,
        ))
    return storages, layers


def export_kv_caches(kv_caches: dict[str, torch.Tensor], block_size: int,
                     files: HandoverFiles, groups: list[int] | None = None,
                     states: list[bool] | None = None
                     ) -> tuple[list[MemoryHandle], list[LayerSpec], list[torch.UntypedStorage]]:
    """(one memory handle per distinct allocation, one LayerSpec per layer name (in KV
    cache group `groups[i]`, default 0), the CUDA aliases to keep until the server has
    unmapped them); CPU allocations' descriptors are added to `files`."""
    # Described before any sharing: sharing a CPU storage moves its pages, and views of
    # it report the new address afterwards.
    storages, layers = describe_kv_caches(kv_caches, block_size, groups, states)
    handles: list[MemoryHandle] = []
    aliases: list[torch.UntypedStorage] = []
    exported: dict[int, tuple[int, int]] = {}
    for storage in storages:
        if storage.device.type == "cpu":
            handles.append(_share_cpu(storage, files))
            continue
        vmm = export_driver_mapped(storage, files, exported)
        if vmm is not None:
            handles.append(vmm)
        else:
            handle, alias = _share_cuda(storage)
            handles.append(handle)
            aliases.append(alias)
    return handles, layers, aliases
