"""A CUDA engine in namespaces of its own, beside a server in others (GPU; needs root).

The engine (`support/engine.py`, driver-mapped KV memory as vLLM 0.34's extensible KV cache
allocates it) runs in new PID, network, IPC and mount namespaces as uid 65534, sharing
only the server's socket directory: its memory reaches the server as POSIX descriptors
over the handover socket there, which needs no shared IPC or PID namespace. Both see the
GPU through the host's /dev (a mount namespace copies it).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.testbed.server_process import free_port
from tests.gpu.support.depot_server import child_env, script
from tests.support.namespaces import (
    NEEDS_NAMESPACES,
    NOBODY,
    PYTHON,
    NamespacedServer,
    add_credential,
    isolated,
    private_dir,
    readable_python,
    start,
    stop,
)

pytestmark = NEEDS_NAMESPACES


@pytest.fixture
def ns_server(tmp_path: Path) -> Iterator[NamespacedServer]:
    tmp_path.chmod(0o755)
    server = NamespacedServer(tmp_path, free_port(), chunk_size=256, l1_size="2GiB")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _engine(server: NamespacedServer, tmp_path: Path, credential: str, *args: str
            ) -> subprocess.Popen[str]:
    home = private_dir(tmp_path / "home", NOBODY)
    add_credential(server, credential, NOBODY, home / "credential.json")
    python = readable_python(tmp_path / "python")
    command = isolated(script("engine", "ipc:///tmp/sockets/kvdepot.sock", "driver_mapped",
                              *args, python=PYTHON),
                       {"sockets": server.socket_dir, "home": home, "python": python},
                       uid=NOBODY, workdir="/tmp/home", read_only=("sockets",))
    env = dict(child_env(), HOME="/tmp/home", KVDEPOT_CREDENTIALS="/tmp/home/credential.json")
    return start(command, tmp_path / "engine.log", stdout=subprocess.PIPE, text=True, env=env)


def test_a_cuda_engine_in_its_own_namespaces_round_trips_bit_exact_and_is_reaped(
        ns_server: NamespacedServer, tmp_path: Path) -> None:
    engine = _engine(ns_server, tmp_path, "gpu-engine", "7", "3")
    try:
        assert engine.stdout is not None
        lines = engine.stdout.read().split()
        assert engine.wait(timeout=600) == 0, (tmp_path / "engine.log").read_text()[-3000:]
        assert lines[:1] == ["ready"] and "ok" in lines, lines
    finally:
        stop(engine)
    ns_server.wait_for("registered_engines", lambda n: n == 0)

    # Killed mid-work: the server sees no pid of its namespace, and reaps it by its pidfd.
    (tmp_path / "killed").mkdir(mode=0o755)
    engine = _engine(ns_server, tmp_path / "killed", "gpu-engine-killed", "8", "0", "256",
                     "--forever")
    try:
        assert engine.stdout is not None
        assert engine.stdout.readline().strip() == "ready"
        ns_server.wait_for("registered_engines", lambda n: n == 1)
    finally:
        stop(engine)
    # (The count goes up once the mapping is released, after the registration is gone.)
    stats = ns_server.wait_for("reaped_engines", lambda n: n == 1, timeout=120)
    assert stats["registered_engines"] == 0
