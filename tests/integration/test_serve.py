"""Properties of the `kvdepot serve` process itself."""

import os
import platform
import subprocess
import sys

import pytest

from kvdepot.rpc.connection import wait_for_server
from kvdepot.server.streaming_stores import THRESHOLD, TUNABLE
from tests.support.server import free_port

glibc_x86 = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() == "x86_64"
         and platform.libc_ver()[0] == "glibc"),
    reason="glibc's non-temporal threshold is an x86-64 glibc tunable")


def _serve_environment(env: dict[str, str]) -> str:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvdepot.cli", "serve", "--port", str(port),
                             "--l1-size", "64MiB"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for_server(f"tcp://127.0.0.1:{port}", 60, proc)
        # The same PID after re-executing. (glibc may rewrite a multi-tunable value in
        # this copy of the environment, so the tests set one tunable at most.)
        with open(f"/proc/{proc.pid}/environ", "rb") as f:
            return f.read().decode()
    finally:
        proc.terminate()
        proc.wait(30)


@glibc_x86
def test_the_server_copies_with_streaming_stores():
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    environ = _serve_environment(env).split("\0")
    assert f"GLIBC_TUNABLES={TUNABLE}={THRESHOLD:#x}" in environ


@glibc_x86
def test_an_operators_own_threshold_is_kept():
    mine = f"{TUNABLE}=0x100000"
    environ = _serve_environment({**os.environ, "GLIBC_TUNABLES": mine}).split("\0")
    assert f"GLIBC_TUNABLES={mine}" in environ


def test_a_server_that_prints_a_lot_is_not_blocked_by_its_captured_output():
    """What a captured server prints goes to a file: a pipe nobody reads until `stop()`
    fills up and then blocks the server in its next write."""
    from tests.support.server import small_server

    server = small_server()
    # A megabyte on stdout first, then the real server in the same process.
    chatty = ("import os, sys; sys.stdout.write('x' * (1 << 20)); sys.stdout.flush(); "
              "os.execv(sys.executable, sys.argv[1:])")
    server.args = [sys.executable, "-c", chatty, *server.args]
    try:
        server.start(timeout=60)
    finally:
        printed = server.stop()
    assert printed.startswith("x" * (1 << 20))
    assert "kvdepot listening on" in printed
