"""The server notices engine workers that died without unregistering."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvdepot.server.engines import EngineRegistry, RegisteredEngine
from kvdepot.server.worker_process import WorkerProcess, process_start
from kvdepot.transfer.fence import ClientFence, ServerFence


class _NullCopier:
    closed = False

    def gather(self, *args: object) -> None: ...

    def scatter(self, *args: object) -> None: ...

    def close(self) -> None:
        self.closed = True


def _watch(registry: EngineRegistry, instance_id: bytes, pid: int) -> _NullCopier:
    process = WorkerProcess.of(pid)
    assert process is not None
    copier = _NullCopier()
    client_fence = ClientFence(slots=8)
    registry._engines[instance_id] = RegisteredEngine(
        instance_id, 1, b"\0conn", "owner", "", "m", 1, 0, layout=None,  # type: ignore[arg-type]
        blocks_per_chunk=1, chunk_bytes=0, copier=copier,
        fence=ServerFence(os.dup(client_fence.fd), client_fence.nbytes), process=process)
    return copier


def test_a_killed_worker_is_reported_dead_and_its_registration_released() -> None:
    registry = EngineRegistry(chunk_size=256, max_chunk_bytes=1 << 30, max_registered_bytes=1 << 40,
                              tenant_max_registered_bytes=1 << 40)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    copier = _watch(registry, b"7", child.pid)
    _watch(registry, b"8", os.getpid())
    assert registry.dead() == []
    child.kill()
    # Not yet waited for: a zombie counts as dead too.
    deadline = time.monotonic() + 10
    while not registry.dead() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [engine.instance_id for engine in registry.dead()] == [b"7"]
    assert not registry.unregister(b"7", b"\0another connection")
    assert registry.unregister(b"7")
    assert copier.closed
    assert registry.dead() == []
    child.wait()


def test_a_pid_that_does_not_exist_has_no_start_time() -> None:
    assert process_start(2**22 + 12345) is None
    assert WorkerProcess.of(2**22 + 12345) is None
