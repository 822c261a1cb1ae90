"""An engine that unregisters exits without torch's warning about shared CUDA memory.

Torch prints "Producer process has been terminated before all shared CUDA tensors
released" at exit when memory it exported through CUDA IPC may still be mapped by
another process. After the worker's shutdown the server has unmapped the KV cache, so
the engine must exit silently; one that exits still registered gets the warning (the
control: it shows the check can see the message).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest

from kvdepot.testbed.server_process import ServerProcess
from tests.gpu.support.depot_server import child_env, script, start_server

WARNING = "Producer process has been terminated before all shared"


@pytest.fixture(scope="module")
def depot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server("auto", tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    srv.stop()


def _run_engine(depot: ServerProcess, how: str) -> str:
    """The engine's stderr, after it exited cleanly."""
    done = subprocess.run(script("engine_exit", depot.url, how), env=child_env(),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == "done", (done.stdout, done.stderr)
    return done.stderr


def _registrations_drop_to_zero(depot: ServerProcess) -> None:
    deadline = time.monotonic() + 30
    while depot.stats()["registered_engines"] > 0:
        assert time.monotonic() < deadline, "the engine's registration was never dropped"
        time.sleep(0.2)


def test_engine_exits_without_the_shared_memory_warning_after_shutdown(
        depot: ServerProcess) -> None:
    stderr = _run_engine(depot, "shutdown")
    assert WARNING not in stderr, stderr
    assert depot.stats()["registered_engines"] == 0
    assert depot.alive()


def test_engine_exiting_while_registered_gets_the_warning(depot: ServerProcess) -> None:
    stderr = _run_engine(depot, "no-shutdown")
    assert WARNING in stderr, stderr
    _registrations_drop_to_zero(depot)  # reaped as a dead engine
    assert depot.alive()
