"""vLLM's sleep mode on a GPU before 0.34: its KV cache made exportable, its sleep made known.

vLLM 0.26-0.33 allocate a sleep-mode engine's KV cache through their CuMemAllocator: each
tensor's storage is a reserved address range with one physical allocation behind it, made
without an exportable handle type, released by `sleep()` and made again, the same way and
at the same address, by `wake_up()`. The allocator records each allocation as (device,
size, address, pointer to its handle) and releases whatever handle that pointer holds.

So at registration the worker moves each KV allocation onto exportable memory with the
same address and contents (`back_with_exportable`) and writes the new handle where the
allocator keeps it; and for those addresses it stands in for the allocator module's
`create_and_map`, which `wake_up()` calls per allocation, mapping exportable memory there
instead. The server then maps the KV cache through POSIX descriptors, as vLLM 0.34's.

vLLM 0.26-0.32 never tell a connector that the engine sleeps. For them the allocator's own
`sleep` and `wake_up` are wrapped: the worker unregisters (draining its transfers, so no
copy touches memory about to be released) before the memory goes, and registers again once
all of its KV memory is mapped. vLLM 0.33 calls the connector's hooks at those points.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kvdepot.client.cuda_vmm_rebacking import back_with_exportable, map_exportable

log = logging.getLogger(__name__)

_exportable: set[int] = set()
"""Addresses of the allocations moved onto exportable memory (one engine per process)."""
_hooks: dict[str, Callable[[], None]] = {}
"""The worker's `on_sleep` and `on_wake`, for vLLM that has no connector sleep hooks."""


def _cumem() -> ModuleType | None:
    try:
        from vllm.device_allocator import cumem
    except ImportError:
        return None
    return cumem if getattr(cumem, "cumem_available", False) else None


def can_make_exportable() -> bool:
    """Whether this vLLM's sleep-mode KV memory can be made exportable here: a CUDA build
    whose CuMem allocator records one handle per allocation (ROCm's keeps lists)."""
    cumem = _cumem()
    return (cumem is not None and torch.version.hip is None
            and callable(getattr(cumem, "create_and_map", None))
            and callable(getattr(getattr(cumem, "CuMemAllocator", None), "get_instance", None)))


def make_exportable(kv_caches: dict[str, torch.Tensor],
                    on_sleep: Callable[[], None] | None = None,
                    on_wake: Callable[[], None] | None = None) -> int:
    """Move the CuMem allocations under `kv_caches` onto exportable memory and keep them so
    across wake-ups; with `on_sleep` and `on_wake`, call them before the allocator releases
    memory and after it has mapped all of these allocations again. Returns how many
    allocations were moved (0: none of this memory is the allocator's)."""
    cumem = _cumem()
    allocator = None if cumem is None else cumem.CuMemAllocator.instance
    if allocator is None:
        return 0
    records = allocator.pointer_to_data
    moved = 0
    for address in _allocations_under(kv_caches, records):
        if address in _exportable:
            continue
        device, size, _, handle_slot = records[address].handle
        if not moved:
            torch.cuda.synchronize(device)  # nothing of the engine's may touch it mid-move
        slot = ctypes.c_uint64.from_address(handle_slot)
        slot.value = back_with_exportable(address, size, device, slot.value)
        _exportable.add(address)
        moved += 1
    _stand_in_for_create_and_map(cumem)
    if on_sleep is not None and on_wake is not None:
        _hooks.update(on_sleep=on_sleep, on_wake=on_wake)
        _wrap_sleep(allocator, records)
    log.info("kvdepot: %d sleep-mode KV allocations moved onto exportable memory", moved)
    return moved


def _allocations_under(kv_caches: dict[str, torch.Tensor], records: dict[int, Any]
                       ) -> list[int]:
    """The addresses of the allocator's allocations holding the tensors' storages."""
    spans = [(address, address + record.handle[1]) for address, record in records.items()]
    found: list[int] = []
    for tensor in kv_caches.values():
        storage = tensor.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        for low, high in spans:
            if low <= start and end <= high and low not in found:
                found.append(low)
    return found


def _stand_in_for_create_and_map(cumem: ModuleType) -> None:
    if getattr(cumem.create_and_map, "kvdepot_original", None) is not None:
        return
    original = cumem.create_and_map

    def create_and_map(handle: Any) -> None:
        device, size, address, handle_slot = handle
        if address not in _exportable:
            original(handle)
            return
        ctypes.c_uint64.from_address(handle_slot).value = map_exportable(address, size,
                                                                         device)

    create_and_map.kvdepot_original = original  # type: ignore[attr-defined]
    cumem.create_and_map = create_and_map


def _wrap_sleep(allocator: Any, records: dict[int, Any]) -> None:
    if getattr(allocator, "kvdepot_wrapped", False):
        return
    sleep, wake_up = allocator.sleep, allocator.wake_up

    def sleep_after_unregistering(*args: Any, **kwargs: Any) -> None:
        _hooks["on_sleep"]()
        sleep(*args, **kwargs)

    def wake_up_then_register(*args: Any, **kwargs: Any) -> None:
        wake_up(*args, **kwargs)
        if all(not records[address].is_asleep for address in _exportable
               if address in records):
            _hooks["on_wake"]()

    allocator.sleep = sleep_after_unregistering
    allocator.wake_up = wake_up_then_register
    allocator.kvdepot_wrapped = True
