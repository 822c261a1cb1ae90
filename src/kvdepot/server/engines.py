"""Engine workers that registered their KV cache, and the mapped memory of each."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvdepot.errors import InvalidRequest, NotRegistered
from kvdepot.protocol import CudaIPCMemory, RegisterKVCache, SharedCPUMemory
from kvdepot.transfer.cpu_copier import CPUCopier
from kvdepot.transfer.fence import ServerFence
from kvdepot.transfer.layout import CopyPlan, KVLayout, blocks_per_chunk
from kvdepot.transfer.shm_mapping import open_shared_cpu, open_shared_file

log = logging.getLogger(__name__)


class Copier(Protocol):
    def gather(self, plan: CopyPlan, chunks: list[np.ndarray],
               event_handle: bytes | None = None) -> None: ...

    def scatter(self, plan: CopyPlan, chunks: list[np.ndarray],
                event_handle: bytes | None = None) -> bytes | None: ...

    def close(self) -> None: ...


@dataclass
class RegisteredEngine:
    instance_id: int
    model: str
    world_size: int
    rank: int
    layout: KVLayout
    blocks_per_chunk: int
    """Engine blocks in one chunk of the server's chunk size."""
    chunk_bytes: int
    """Bytes of one chunk of this engine in the cache."""
    copier: Copier
    fence: ServerFence
    """Decides, per operation, whether the worker still waits for it (see transfer.fence)."""
    keepalive: list[Any] = field(default_factory=list)
    """Mapped storages: the mapping lives exactly as long as this registration."""
    process: tuple[int, int] | None = None
    """(pid, start time) of the worker when it can be watched from here, else None."""


def _process_start(pid: int) -> int | None:
    """The start time of process `pid` as /proc tells it, None if there is none.

    With the start time a reused pid is not mistaken for the worker; a worker in another
    pid namespace usually has no such pid here and is then never reaped.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces): state first, start time 20th.
    fields = stat[stat.rindex(b")") + 2:].split()
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def _map_cpu(handles: list[SharedCPUMemory]) -> tuple[CPUCopier, list[Any], list[int]]:
    storages, arrays = [], []
    for handle in handles:
        storage, array = open_shared_cpu(handle)
        storages.append(storage)
        arrays.append(array)
    return CPUCopier(arrays), storages, [a.nbytes for a in arrays]


class EngineRegistry:
    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._engines: dict[int, RegisteredEngine] = {}
        self._mutex = threading.Lock()

    def __len__(self) -> int:
        return len(self._engines)

    def register(self, request: RegisterKVCache) -> RegisteredEngine:
        if not request.allocations:
            raise InvalidRequest("register_kv_caches sent no memory")
        chunk_blocks = blocks_per_chunk(self.chunk_size, request.block_size)
        if not 0 <= request.rank < request.world_size:
            raise InvalidRequest(f"KV rank {request.rank} is outside world size "
                                 f"{request.world_size}")
        kinds = {type(h) for h in request.allocations}
        if kinds not in ({SharedCPUMemory}, {CudaIPCMemory}):
            raise InvalidRequest("a KV cache registration must be all CPU or all CUDA memory")
        if request.fence is None:
            raise InvalidRequest("a KV cache registration must carry its fence (this client "
                                 "is older than the server)")
        fence = ServerFence(open_shared_file(request.fence), request.fence.nbytes)
        try:
            if kinds == {SharedCPUMemory}:
                copier, keepalive, sizes = _map_cpu(request.allocations)  # type: ignore[arg-type]
            else:
                from kvdepot.transfer.cuda_ipc_mapping import map_cuda  # torch.cuda, lazily

                copier, keepalive, sizes = map_cuda(request.allocations)  # type: ignore[arg-type]
        except BaseException:
            fence.close()
            raise
        try:
            layout = KVLayout(request.layers, sizes, request.block_size)
        except Exception:
            copier.close()
            fence.close()
            raise
        start = _process_start(request.engine_pid) if request.engine_pid > 0 else None
        engine = RegisteredEngine(request.instance_id, request.model, request.world_size,
                                  request.rank, layout, chunk_blocks,
                                  chunk_blocks * layout.block_bytes, copier, fence, keepalive,
                                  None if start is None else (request.engine_pid, start))
        with self._mutex:
            previous = self._engines.pop(request.instance_id, None)
            self._engines[request.instance_id] = engine
        if previous is not None:
            previous.copier.close()
            previous.fence.close()
        log.info("registered engine %x: model %s, rank %d/%d, %d layers, %d blocks of %d tokens",
                 request.instance_id, request.model, request.rank, request.world_size,
                 len(request.layers), layout.num_blocks, layout.block_size)
        return engine

    def get(self, instance_id: int) -> RegisteredEngine:
        engine = self._engines.get(instance_id)
        if engine is None:
            raise NotRegistered(f"no KV cache is registered under instance {instance_id:x}; "
                                "register_kv_caches must come first (or the server restarted)")
        return engine

    def unregister(self, instance_id: int) -> bool:
        with self._mutex:
            engine = self._engines.pop(instance_id, None)
        if engine is None:
            return False
        engine.copier.close()
        engine.fence.close()
        engine.keepalive.clear()
        log.info("unregistered engine %x", instance_id)
        return True

    def dead(self) -> list[int]:
        """Registrations whose worker process has exited (killed engines never unregister)."""
        return [e.instance_id for e in list(self._engines.values())
                if e.process is not None and _process_start(e.process[0]) != e.process[1]]

    def close(self) -> None:
        for instance_id in list(self._engines):
            self.unregister(instance_id)
