"""Driver-mapped (VMM) KV memory on the GPU: allocated as vLLM 0.34's extensible KV cache
allocates it (`vmm_memory.DriverMappedKV`), registered with a real `kvdepot serve` through
POSIX descriptors, stored and loaded byte-exact; and the refusals: memory made without an
exportable handle type (sleep mode before vLLM 0.34), a descriptor of another kind, sizes
that lie, a registration from another process than the one that handed the memory over,
and an engine killed mid-copy. After each refusal nothing stays mapped: the memory goes
back to the driver once the engine lets go of it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from kvdepot.client.kv_export import export_kv_caches
from kvdepot.client.memory_handover import HandoverFiles
from kvdepot.client.worker import WorkerClient
from kvdepot.errors import InvalidRequest
from kvdepot.protocol import CudaVMMMemory, RegisterKVCache, RequestType
from kvdepot.rpc.connection import DepotConnection
from kvdepot.testbed.server_process import ServerProcess
from tests.gpu.support.depot_server import child_env, script
from tests.gpu.support.engine import Engine
from tests.gpu.support.kv_layouts import BLOCK
from tests.gpu.support.vmm_memory import NO_EXPORT, DriverMappedKV
from tests.support import raw_registration
from tests.support.raw_registration import hand_over_memory

WAIT = 60.0
DEVICE = torch.device("cuda", 0)
BIG_BLOCKS = 32768
"""1 GiB over 4 layers: plain in the device's free-memory figure."""
SLACK = 512 << 20
"""What the device's free memory may stay below where it was: a copy process keeps the
staging buffers it used (4 x 64 MiB) in torch's cache."""


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(DEVICE)[0]


def wait_for_free(at_least: int, timeout: float = 20.0) -> str:
    """'' once the device's free memory is back to `at_least`, within `timeout`; else
    how far it stayed below."""
    deadline = time.monotonic() + timeout
    while (free := free_bytes()) < at_least:
        if time.monotonic() > deadline:
            return f"{(at_least - free) >> 20} MiB short of {at_least >> 20} MiB free"
        time.sleep(0.2)
    return ""


def log_tail(server: ServerProcess, lines: int = 30) -> str:
    """The server log's last lines, for a failure's message."""
    try:
        text = Path(server.output).read_text(errors="replace")  # type: ignore[arg-type]
    except (OSError, TypeError):
        return "(no server log)"
    return "\n".join(text.splitlines()[-lines:])


@pytest.fixture
def conn(server: ServerProcess) -> Iterator[DepotConnection]:
    torch.cuda.set_device(DEVICE)
    connection = DepotConnection(server.url)
    yield connection
    connection.close()


def _register(conn: DepotConnection, request: RegisterKVCache) -> None:
    conn.submit(RequestType.REGISTER_KV_CACHE, request).result(WAIT)


@pytest.mark.parametrize("per_allocation", [1, 2])
def test_driver_mapped_kv_round_trip_is_bit_exact(server: ServerProcess,
                                                  per_allocation: int) -> None:
    """One allocation per layer (vLLM 0.34), and two layers' storages in each (the second
    starting inside it); each storage spans less than its allocation."""
    torch.cuda.set_device(DEVICE)
    kv = DriverMappedKV(200, DEVICE, per_allocation=per_allocation)
    files = HandoverFiles()
    try:
        handles, _, _ = export_kv_caches(kv.caches, BLOCK, files)
        assert all(isinstance(h, CudaVMMMemory) for h in handles), handles
        assert len(files.fds) == len(kv.mapped)  # one descriptor per allocation
        assert {h.offset for h in handles} == {i * kv.layer_bytes for i in range(per_allocation)}
        assert all(h.nbytes == kv.layer_bytes < h.allocation_bytes for h in handles)
    finally:
        files.close()
    engine = Engine(server.url, f"driver-mapped-{per_allocation}", num_blocks=200,
                    caches=kv.caches)
    try:
        assert server.stats()["registered_engines"] == 1
        for seed in range(3):
            assert engine.round_trip(seed * 13 + per_allocation, chunks=1 + seed)
    finally:
        engine.close()
        kv.free()
    assert server.stats()["registered_engines"] == 0


def test_unregistered_memory_goes_back_to_the_driver(server: ServerProcess) -> None:
    """The copy process unmaps at unregistration: once the engine frees its allocations
    too, the device has the memory back."""
    torch.cuda.set_device(DEVICE)
    before = free_bytes()
    kv = DriverMappedKV(BIG_BLOCKS, DEVICE)
    engine = Engine(server.url, "driver-mapped-big", num_blocks=BIG_BLOCKS, caches=kv.caches)
    try:
        assert engine.round_trip(3)
    finally:
        engine.close()
        kv.free()
    short = wait_for_free(before - SLACK)
    assert not short, f"the copy process still maps the engine's memory: {short}"


def test_memory_without_an_exportable_handle_type_is_refused(server: ServerProcess) -> None:
    """vLLM's sleep-mode CuMemAllocator before 0.34 calls cuMemCreate without a handle
    type: neither IPC nor a descriptor can share it. The worker says so, naming sleep
    mode, and sends nothing."""
    torch.cuda.set_device(DEVICE)
    kv = DriverMappedKV(64, DEVICE, handle_types=NO_EXPORT)
    worker = WorkerClient(server.url, None, "driver-mapped-unexportable", world_size=1,
                          kv_rank=0, vllm_block_size=BLOCK, mq_timeout=WAIT)
    try:
        with pytest.raises(InvalidRequest, match=r"without an exportable handle type.*sleep"):
            export_kv_caches(kv.caches, BLOCK, HandoverFiles())
        with pytest.raises(InvalidRequest, match="sleep mode"):
            worker.register_kv_caches(kv.caches)
        assert server.stats()["registered_engines"] == 0
    finally:
        worker.shutdown()
        kv.free()
    assert server.alive()


def _memfd() -> int:
    fd = os.memfd_create("not-cuda-memory")
    os.ftruncate(fd, 2 << 20)
    return fd


def _file() -> int:
    fd, path = tempfile.mkstemp()
    os.unlink(path)
    os.write(fd, b"x" * 4096)
    return fd


def _socket() -> int:
    a, b = socket.socketpair()
    b.close()
    return a.detach()


def _dev_null() -> int:
    return os.open("/dev/null", os.O_RDWR)


OTHER_KINDS: dict[str, tuple[Callable[[], int], str]] = {
    "memfd": (_memfd, "is a file, not an export of CUDA memory"),
    "regular file": (_file, "is a file, not an export of CUDA memory"),
    "socket": (_socket, "is a socket, not an export of CUDA memory"),
    "character device": (_dev_null, "not exported CUDA memory this GPU can import"),
}


def _hand_over_with(conn: DepotConnection, monkeypatch: pytest.MonkeyPatch,
                    kv: DriverMappedKV, replace: Callable[[list[int], list], None]
                    ) -> RegisterKVCache:
    """Export `kv` as the worker does, let `replace` change the descriptors or handles,
    hand the result over; returns the registration."""
    real = raw_registration.export_kv_caches

    def export(caches, block_size, files, groups=None):  # type: ignore[no-untyped-def]
        handles, layers, aliases = real(caches, block_size, files, groups)
        replace(files.fds, handles)
        return handles, layers, aliases

    monkeypatch.setattr(raw_registration, "export_kv_caches", export)
    request, fds = hand_over_memory(conn, kv.caches, BLOCK)
    for fd in fds[:-1]:  # the fence is the test module's
        os.close(fd)
    return request


@pytest.mark.parametrize("kind", sorted(OTHER_KINDS))
def test_a_descriptor_of_another_kind_is_refused_and_nothing_is_mapped(
        server: ServerProcess, conn: DepotConnection, monkeypatch: pytest.MonkeyPatch,
        kind: str) -> None:
    make, message = OTHER_KINDS[kind]
    before = free_bytes()
    kv = DriverMappedKV(BIG_BLOCKS, DEVICE)

    def swap(fds: list[int], handles: list) -> None:
        os.close(fds[handles[1].fd_index])
        fds[handles[1].fd_index] = make()

    request = _hand_over_with(conn, monkeypatch, kv, swap)
    with pytest.raises(InvalidRequest, match=message):
        _register(conn, request)
    assert server.stats()["registered_engines"] == 0
    kv.free()
    short = wait_for_free(before - SLACK)
    assert not short, f"a refused registration left engine memory mapped: {short}"
    again = DriverMappedKV(64, DEVICE)  # the copy process still serves
    engine = Engine(server.url, "driver-mapped-after-refusal", num_blocks=64,
                    caches=again.caches)
    try:
        assert engine.round_trip(5)
    finally:
        engine.close()
        again.free()


LIES: dict[str, tuple[Callable[[CudaVMMMemory], CudaVMMMemory], str]] = {
    "allocation twice its size": (
        lambda h: msgspec.structs.replace(h, allocation_bytes=2 * h.allocation_bytes),
        "cannot map"),
    "allocation not whole granules": (
        lambda h: msgspec.structs.replace(h, allocation_bytes=h.allocation_bytes + 4096),
        "granules"),
    "storage past its allocation": (
        lambda h: msgspec.structs.replace(h, nbytes=h.allocation_bytes - h.offset + 4096),
        "of an allocation of"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_sizes_that_lie_are_refused_and_nothing_is_mapped(
        server: ServerProcess, conn: DepotConnection, monkeypatch: pytest.MonkeyPatch,
        lie: str) -> None:
    change, message = LIES[lie]
    before = free_bytes()
    kv = DriverMappedKV(BIG_BLOCKS, DEVICE)

    def lying(fds: list[int], handles: list) -> None:
        handles[-1] = change(handles[-1])

    request = _hand_over_with(conn, monkeypatch, kv, lying)
    with pytest.raises(InvalidRequest, match=message):
        _register(conn, request)
    assert server.stats()["registered_engines"] == 0
    kv.free()
    short = wait_for_free(before - SLACK)
    assert not short, f"a refused registration left engine memory mapped: {short}"


def test_memory_handed_over_by_another_process_is_refused(server: ServerProcess,
                                                          conn: DepotConnection) -> None:
    """A child hands its driver-mapped memory over; this process registers it under the
    child's ticket, claiming itself, and is refused, as for shared memory: the ticket's
    descriptors are dropped and the child's memory goes back once it exits."""
    before = free_bytes()
    child = subprocess.Popen(script("vmm_sender", server.url, str(BIG_BLOCKS)),
                             env=child_env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline().strip()
        assert line, f"the sender failed (status {child.poll()})"
        request = msgspec.msgpack.decode(bytes.fromhex(line), type=RegisterKVCache)
        assert all(isinstance(h, CudaVMMMemory) for h in request.allocations)
        request.engine_pid = os.getpid()
        with pytest.raises(InvalidRequest, match="the kernel reported pid"):
            _register(conn, request)
        assert server.stats()["registered_engines"] == 0
        child.stdin.close()
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    short = wait_for_free(before - SLACK)
    assert not short, f"the refused memory is still mapped somewhere: {short}"


def test_an_engine_killed_mid_copy_is_reaped_and_its_memory_freed(
        server: ServerProcess) -> None:
    assert server.stats()["registered_engines"] == 0, \
        f"a registration was left from an earlier test:\n{log_tail(server)}"
    before = free_bytes()
    # ~2 GiB of driver-mapped KV, so whether it comes back is plain in the free memory.
    proc = subprocess.Popen(script("engine", server.url, "driver_mapped", "21", "0", "65536",
                                   "--forever"),
                            env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.5)  # stores and retrieves are in flight now
        assert server.stats()["registered_engines"] >= 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # The server checks once a second; a copy process that died of the engine's
        # death restarts meanwhile (seconds: it page-locks the pool).
        deadline = time.monotonic() + 60
        while server.stats()["registered_engines"] > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.stats()["registered_engines"] == 0, \
            f"the dead engine was never reaped; the server's log ends:\n{log_tail(server)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    short = wait_for_free(before - (512 << 20))
    assert not short, f"the dead engine's GPU memory is still held: {short}"
    assert server.alive()
    kv = DriverMappedKV(64, DEVICE)
    engine = Engine(server.url, "driver-mapped-after-kill", num_blocks=64, caches=kv.caches)
    try:
        assert engine.round_trip(99)
    finally:
        engine.close()
        kv.free()
