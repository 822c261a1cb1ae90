"""Engine workers that registered their KV cache, and the mapped memory of each.

A registration's id is generated here (128 random bits), returned to the worker and
never logged (logs name registrations by a sequence number); it is valid only on the
ZeroMQ connection that registered, so knowing it is not enough to use it.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvdepot.errors import InvalidRequest, NotRegistered
from kvdepot.protocol import CudaIPCMemory, CudaVMMMemory, RegisterKVCache, SharedCPUMemory
from kvdepot.rpc.auth import Caller
from kvdepot.server.handover import HandedOverFiles
from kvdepot.server.peer_pidfd import PidfdProcess
from kvdepot.server.worker_process import WorkerProcess
from kvdepot.sizes import format_size
from kvdepot.transfer.cpu_copier import CPUCopier
from kvdepot.transfer.engine_layout import EngineLayout
from kvdepot.transfer.fence import ServerFence
from kvdepot.transfer.group_copy import GroupCopy
from kvdepot.transfer.layout import blocks_per_chunk
from kvdepot.transfer.shm_mapping import check_shared_fd

log = logging.getLogger(__name__)


class Copier(Protocol):
    """Moves one operation's blocks, every KV cache group of it in one call."""

    def gather(self, groups: Sequence[GroupCopy], event_handle: bytes | None = None
               ) -> None: ...

    def scatter(self, groups: Sequence[GroupCopy], event_handle: bytes | None = None
                ) -> None: ...

    def close(self) -> None: ...


@dataclass
class RegisteredEngine:
    instance_id: bytes
    label: int
    """Names the registration in logs (the id is a secret)."""
    connection: bytes
    """The ROUTER routing id of the connection that registered."""
    credential: str
    tenant: str
    model: str
    world_size: int
    rank: int
    layout: EngineLayout
    blocks_per_chunk: int
    """Engine blocks in one chunk of the server's chunk size."""
    chunk_bytes: int
    """Bytes of one chunk of this engine in the cache."""
    copier: Copier
    fence: ServerFence
    """Decides, per operation, whether the worker still waits for it (see transfer.fence)."""
    keepalive: list[Any] = field(default_factory=list)
    """Mapped storages: the mapping lives exactly as long as this registration."""
    process: WorkerProcess | PidfdProcess | None = None
    """The worker's process (a pidfd's is closed with the registration); None only for
    registrations made without a handover's process, which are never reaped."""
    host_bytes: int = 0
    """Bytes of host memory the registration maps (its CPU allocations; 0 for CUDA
    memory, which lives on the GPUs)."""

    def __str__(self) -> str:
        return f"engine #{self.label}"


CudaCopies = Callable[[RegisterKVCache, int, int, dict[int, int]], Copier]
"""Maps a CUDA registration whose layout was found valid (the request, the pid and uid of
the process that handed it over, and the handed-over descriptors of its driver-mapped
allocations by index) into a copier opened in its GPU's copy process
(`CopyProcesses.map`)."""


def no_cuda_copies(request: RegisterKVCache, pid: int, uid: int,
                   vmm_fds: dict[int, int] | None = None) -> Copier:
    """A server without copy processes (it sees no GPU): the registration is checked as
    anywhere else (its reference counters first), then refused."""
    from kvdepot.transfer.cuda_ipc_mapping import checked_device  # torch.cuda, lazily

    checked_device(request.allocations, pid, uid)  # type: ignore[arg-type]
    raise InvalidRequest("the engine registered CUDA memory, but this kvdepot server runs "
                         "no GPU copy processes (it saw no CUDA device when it started)")


def _map_cpu(handles: list[SharedCPUMemory], files: HandedOverFiles
             ) -> tuple[CPUCopier, list[Any], list[int]]:
    storages, arrays = [], []
    for handle in handles:
        storage, array = files.map(handle)
        storages.append(storage)
        arrays.append(array)
    return CPUCopier(arrays), storages, [a.nbytes for a in arrays]


_NOT_REGISTERED = ("no KV cache is registered under this instance id on this connection; "
                   "register_kv_caches must come first (or the server restarted, or the "
                   "worker reconnected and must register again)")


MAX_REGISTRATIONS_PER_CONNECTION = 16
"""KV cache registrations one connection may hold: a worker holds one (its rank's), and
each keeps the engine's memory mapped and a file descriptor open."""
MAX_REGISTRATIONS_PER_TENANT = 128
"""Registrations of one tenant over all its connections (credentials without a tenant
count as one): a node's GPUs times a few engines each, and no single tenant can take
the server's whole bound."""
MAX_REGISTRATIONS = 1024
"""Registrations in all: far above the engine workers one node runs, far below the
server's file descriptor limit."""


def _same_process(a: RegisteredEngine, b: RegisteredEngine) -> bool:
    if isinstance(a.process, PidfdProcess):
        return a.process.same_process(b.process)
    return a.process == b.process


def _close_process(engine: RegisteredEngine) -> None:
    """Let go of the worker's pidfd, if it has one (a /proc-watched one holds nothing)."""
    if isinstance(engine.process, PidfdProcess):
        engine.process.close()


def _cpu_bytes(request: RegisterKVCache) -> int:
    return sum(h.nbytes for h in request.allocations if isinstance(h, SharedCPUMemory))


class EngineRegistry:
    def __init__(self, chunk_size: int, max_chunk_bytes: int,
                 max_registered_bytes: int, tenant_max_registered_bytes: int,
                 cuda_copies: CudaCopies | None = None) -> None:
        """`max_chunk_bytes`: the largest chunk the cache can hold (its whole capacity);
        `max_registered_bytes`, `tenant_max_registered_bytes`: the CPU KV memory all
        registrations, and those of one named tenant, may map (`Options`' fields of those
        names); `cuda_copies`: how CUDA registrations are mapped (default: refused, no
        GPU)."""
        self._cuda_copies = cuda_copies or no_cuda_copies
        self.chunk_size = chunk_size
        self.max_chunk_bytes = max_chunk_bytes
        # CUDA memory does not count: it costs the host nothing. The owner's scope (no
        # tenant) has only the bound in all: it is the operator's own.
        self.max_registered_bytes = max_registered_bytes
        self.tenant_max_registered_bytes = tenant_max_registered_bytes
        self._engines: dict[bytes, RegisteredEngine] = {}
        self._mutex = threading.Lock()
        self._labels = itertools.count(1)

    def __len__(self) -> int:
        return len(self._engines)

    def _check_one_world_size(self, engine: RegisteredEngine,
                              leaving: RegisteredEngine | None) -> None:
        """A worker belongs to one TP/PP group: its connection may not register one model
        under two KV world sizes (the keys would never meet, and it is a misconfigured
        worker, not a second engine). Called under the lock."""
        for other in self._engines.values():
            if (other is not leaving and other.connection == engine.connection
                    and other.model == engine.model
                    and other.world_size != engine.world_size):
                raise InvalidRequest(
                    f"this connection registered model {engine.model!r} with KV world size "
                    f"{other.world_size} already; it cannot register it with world size "
                    f"{engine.world_size} too")

    def register(self, request: RegisterKVCache, caller: Caller, files: HandedOverFiles
                 ) -> RegisteredEngine:
        """Map the registration's memory (the CPU allocations from `files`) and bind it to
        the caller's connection; a registration it `replaces` (same credential and
        process) is dropped."""
        if not request.allocations:
            raise InvalidRequest("register_kv_caches sent no memory")
        chunk_blocks = blocks_per_chunk(self.chunk_size, request.block_size)
        if not 0 <= request.rank < request.world_size:
            raise InvalidRequest(f"KV rank {request.rank} is outside world size "
                                 f"{request.world_size}")
        kinds = {type(h) for h in request.allocations}
        if kinds != {SharedCPUMemory} and not kinds <= {CudaIPCMemory, CudaVMMMemory}:
            raise InvalidRequest("a KV cache registration must be all CPU or all CUDA memory")
        if request.fence is None:
            raise InvalidRequest("a KV cache registration must carry its fence (this client "
                                 "is older than the server)")
        if files.process is not None and not files.process.alive():
            # Its REGISTER_KV_CACHE waited in a queue (a stalled server) while it died:
            # nobody would ever unregister or use this registration.
            raise InvalidRequest("the worker process that handed this memory over has "
                                 "exited")
        host_bytes = _cpu_bytes(request)
        # Before anything is mapped: a registration past the byte bounds costs nothing.
        self.check_room(caller.connection, caller.identity.tenant, host_bytes)
        check_shared_fd(files.fd(request.fence), request.fence.nbytes, "the fence file")
        # The fence keeps its descriptor: closing any descriptor of the file would drop this
        # process's locks on it.
        fence = ServerFence(files.take(request.fence), request.fence.nbytes)
        try:
            copier, keepalive, layout = self._map(request, files)
        except BaseException:
            fence.close()
            raise
        engine = RegisteredEngine(secrets.token_bytes(16), next(self._labels),
                                  caller.connection, caller.identity.name,
                                  caller.identity.tenant, request.model, request.world_size,
                                  request.rank, layout, chunk_blocks,
                                  chunk_blocks * layout.block_bytes, copier, fence, keepalive,
                                  files.take_process(), host_bytes)
        try:
            if engine.chunk_bytes > self.max_chunk_bytes:
                raise InvalidRequest(f"one chunk of this engine takes {engine.chunk_bytes} "
                                     "bytes, more than the server's whole CPU memory "
                                     f"({self.max_chunk_bytes} bytes)")
            # Checked and applied under one lock, so concurrent registrations cannot all
            # pass the bounds; a refused registration leaves the one it `replaces` in place.
            with self._mutex:
                previous = self._engines.get(request.replaces) if request.replaces else None
                if previous is not None and (previous.credential != engine.credential
                                             or not _same_process(previous, engine)):
                    previous = None  # not this worker's to drop
                self._check_room(caller.connection, engine.tenant, leaving=previous,
                                 host_bytes=host_bytes)
                self._check_one_world_size(engine, leaving=previous)
                self._engines[engine.instance_id] = engine
                if previous is not None:
                    del self._engines[previous.instance_id]
        except BaseException:
            copier.close()
            fence.close()
            _close_process(engine)
            raise
        if previous is not None:
            previous.copier.close()
            previous.fence.close()
            _close_process(previous)
            log.info("%s replaces %s (the worker reconnected)", engine, previous)
        tenant = f", tenant {engine.tenant}" if engine.tenant else ""
        log.info("registered %s (credential %s%s): model %s, rank %d/%d, %d layers in %d KV "
                 "cache group(s), %d blocks of %d tokens", engine, engine.credential, tenant,
                 request.model[:200], request.rank, request.world_size, len(request.layers),
                 len(layout.groups), layout.num_blocks, layout.block_size)
        return engine

    def _map(self, request: RegisterKVCache, files: HandedOverFiles
             ) -> tuple[Copier, list[Any], EngineLayout]:
        """The registration's memory as a copier, and its layout; CUDA memory is opened
        only once the layout is known to be valid."""
        if isinstance(request.allocations[0], SharedCPUMemory):
            copier, keepalive, sizes = _map_cpu(request.allocations, files)  # type: ignore[arg-type]
            try:
                return copier, keepalive, EngineLayout(request.layers, sizes, request.block_size)
            except BaseException:
                copier.close()
                raise
        layout = EngineLayout(request.layers, [h.nbytes for h in request.allocations],
                              request.block_size)
        # Checked here, before any GPU is involved: an index past the handover, or a
        # descriptor that is plainly no CUDA memory export (a file, a socket, a pipe).
        vmm_fds: dict[int, int] = {}
        for handle in request.allocations:
            if isinstance(handle, CudaVMMMemory):
                from kvdepot.transfer.cuda_vmm_mapping import check_vmm_descriptor  # torch

                fd = files.fd(handle)  # type: ignore[arg-type]
                check_vmm_descriptor(fd)
                vmm_fds[handle.fd_index] = fd
        return self._cuda_copies(request, files.pid, files.uid, vmm_fds), [], layout

    def describe(self) -> list[dict[str, object]]:
        """Every registration as the admin API shows it (never its id, a secret)."""
        with self._mutex:
            engines = sorted(self._engines.values(), key=lambda e: e.label)
        return [{"engine": e.label, "credential": e.credential, "tenant": e.tenant,
                 "model": e.model, "rank": e.rank, "world_size": e.world_size,
                 "memory": "cpu" if isinstance(e.copier, CPUCopier) else "cuda",
                 # 0: a process of another PID namespace, which has no pid here.
                 "pid": e.process.pid if e.process and e.process.pid > 0 else None,
                 "layout": {"layers": sum(len(g.layer_names) for g in e.layout.groups),
                            "kv_cache_groups": len(e.layout.groups),
                            "block_size": e.layout.block_size,
                            "num_blocks": e.layout.num_blocks,
                            "block_bytes": e.layout.block_bytes,
                            "fingerprint": e.layout.fingerprint.hex(),
                            # What each KV cache group costs the cache (issue 44): a
                            # chunk holds chunk-size tokens of every attention group; a
                            # recurrent group costs one state (a block) per state kept.
                            "groups": [{"group": g.group, "layers": len(g.layer_names)}
                                       | ({"bytes_per_state": g.block_bytes}
                                          if g in e.layout.state_groups else
                                          {"bytes_per_token": g.block_bytes / g.block_size})
                                       for g in e.layout.groups]},
                 "chunk_bytes": e.chunk_bytes} for e in engines]

    def check_room(self, connection: bytes, tenant: str, host_bytes: int = 0) -> None:
        """Refuse early, before anything is mapped, a registration the bounds would refuse
        (`register` checks again, under the lock); `host_bytes`: the CPU memory it maps."""
        with self._mutex:
            self._check_room(connection, tenant, leaving=None, host_bytes=host_bytes)

    def _check_room(self, connection: bytes, tenant: str,
                    leaving: RegisteredEngine | None, host_bytes: int = 0) -> None:
        """The server's, the tenant's and the connection's bounds on registrations, in
        number and in CPU bytes (`host_bytes`: the new registration's); `leaving` is one
        the new registration replaces. Called with the mutex held."""
        others = [e for e in self._engines.values() if e is not leaving]
        if host_bytes:
            held = sum(e.host_bytes for e in others)
            if held + host_bytes > self.max_registered_bytes:
                raise InvalidRequest(
                    f"registrations map {format_size(held)} of CPU KV memory; this one's "
                    f"{format_size(host_bytes)} would pass the server's bound of "
                    f"{format_size(self.max_registered_bytes)} "
                    "(--max-registered-memory, default: the host's memory)")
            theirs_bytes = sum(e.host_bytes for e in others if e.tenant == tenant)
            if tenant and theirs_bytes + host_bytes > self.tenant_max_registered_bytes:
                raise InvalidRequest(
                    f"tenant {tenant!r} has registered {format_size(theirs_bytes)} of CPU KV "
                    f"memory; this registration's {format_size(host_bytes)} would pass the "
                    f"bound of {format_size(self.tenant_max_registered_bytes)} per tenant "
                    "(--tenant-max-registered-memory, default: half the host's memory); "
                    "unregister one first")
        if len(others) >= MAX_REGISTRATIONS:
            raise InvalidRequest(f"the server holds {MAX_REGISTRATIONS} KV cache "
                                 "registrations, the most it accepts")
        theirs = sum(1 for e in others if e.tenant == tenant)
        if theirs >= MAX_REGISTRATIONS_PER_TENANT:
            raise InvalidRequest(f"this tenant holds {theirs} KV cache registrations, the "
                                 "most one tenant may; unregister one first")
        mine = sum(1 for e in others if e.connection == connection)
        if mine >= MAX_REGISTRATIONS_PER_CONNECTION:
            raise InvalidRequest(f"this connection holds {mine} KV cache registrations, the "
                                 "most one connection may; unregister one first")

    def get(self, instance_id: bytes, connection: bytes) -> RegisteredEngine:
        """The registration `instance_id`, if the caller's `connection` made it."""
        engine = self._engines.get(instance_id)
        if engine is None or engine.connection != connection:
            raise NotRegistered(_NOT_REGISTERED)
        return engine

    def unregister(self, instance_id: bytes, connection: bytes | None = None) -> bool:
        """Drop a registration (only the connection that made it may, unless `connection`
        is None: the server's own reaping)."""
        with self._mutex:
            engine = self._engines.get(instance_id)
            if engine is None or (connection is not None and engine.connection != connection):
                return False
            del self._engines[instance_id]
        engine.copier.close()
        engine.fence.close()
        engine.keepalive.clear()
        _close_process(engine)
        log.info("unregistered %s", engine)
        return True

    def dead(self) -> list[RegisteredEngine]:
        """Registrations whose worker process has exited (killed engines never unregister)."""
        return [e for e in list(self._engines.values())
                if e.process is not None and not e.process.alive()]

    def close(self) -> None:
        for instance_id in list(self._engines):
            self.unregister(instance_id)
