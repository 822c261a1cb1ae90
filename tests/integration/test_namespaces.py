"""Engines and attackers in namespaces of their own, as containers and pods run them.

The server runs in its own PID, network, IPC and mount namespaces (`unshare`); each
engine or attacker runs in others, as uid 65534 (`setpriv`), with a fresh /tmp that
holds only the server's socket directory (and its own files): the only thing it shares
with the server is that directory. Needs root (CI runs as root) and util-linux.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdepot.testbed.server_process import free_port
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
from tests.support.server import small_server

pytestmark = NEEDS_NAMESPACES

WORKDIR = str(Path(__file__).resolve().parents[2])
IPC_URL = "ipc:///tmp/sockets/kvdepot.sock"


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter uid 65534 runs (see `readable_python`), bound as /tmp/python."""
    where = tmp_path_factory.mktemp("python")
    where.parent.chmod(0o755)
    return readable_python(where)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)  # uid 65534 reaches the directories bound from here
    return tmp_path


@pytest.fixture
def server(root: Path) -> Iterator[NamespacedServer]:
    server = NamespacedServer(root, free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


class NamespacedEngine:
    """`tests/support/ns_engine.py` in namespaces of its own as uid 65534, sharing only the
    server's socket directory (and a home holding its credential)."""

    def __init__(self, server: NamespacedServer, name: str, home: Path, python: Path) -> None:
        add_credential(server, name, NOBODY, home / "credential.json")
        command = isolated([PYTHON, "-m", "tests.support.ns_engine", IPC_URL,
                            "/tmp/home/credential.json"],
                           {"sockets": server.socket_dir, "home": home, "python": python},
                           uid=NOBODY, read_only=("sockets",),
                           workdir=WORKDIR)
        self.log = home.parent / f"{name}.log"
        self.proc = start(command, self.log, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          env=dict(os.environ, HOME="/tmp/home"))
        assert self._reply() == {"ready": True}

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the engine exited: {self.log.read_text()[-3000:]}"
        return json.loads(line)

    def roundtrip(self, seed: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "roundtrip", "seed": seed}).encode() + b"\n")
        self.proc.stdin.flush()
        return self._reply()

    def kill(self) -> None:
        stop(self.proc)


def attack(server: NamespacedServer, python: Path, name: str, args: dict[str, Any],
           home: Path | None = None) -> dict[str, str]:
    """Run attack `name` of tests/support/ns_attacks.py in namespaces of its own as uid
    65534, sharing the socket directory (and `home`)."""
    binds = {"sockets": server.socket_dir, "python": python} | ({"home": home} if home else {})
    command = isolated([PYTHON, "-m", "tests.support.ns_attacks", name,
                        json.dumps(args)], binds, uid=NOBODY, workdir=WORKDIR)
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HOME="/tmp"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_engine_in_other_namespaces_stores_loads_byte_exact_and_is_reaped(server, root, python):
    engine = NamespacedEngine(server, "engine", private_dir(root / "home", NOBODY), python)
    try:
        assert engine.roundtrip(1) == {"hit": 64, "exact": True}
        assert server.stats()["registered_engines"] == 1
    finally:
        engine.kill()
    # Its pid in its own namespace means nothing here: only its pidfd proves the exit.
    # (The count goes up once the mapping is released, after the registration is gone.)
    stats = server.wait_for("reaped_engines", lambda n: n == 1)
    assert stats["registered_engines"] == 0
    assert "exited without unregistering" in server.log_text()


def test_one_server_serves_engines_of_its_own_namespaces_and_of_others(root, monkeypatch, python):
    sockets = root / "sockets"
    state = root / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("KVDEPOT_STATE_DIR", str(state))  # the server's, and this test's
    with small_server(extra=("--socket-dir", str(sockets))) as srv:
        owner = str(state / "servers" / f"tcp-{srv.port}.json")
        # An engine beside the server, over TCP and the abstract handover socket, as before.
        beside = subprocess.Popen(
            [sys.executable, "-m", "tests.support.ns_engine", srv.url, owner],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=WORKDIR, text=True)
        try:
            assert json.loads(beside.stdout.readline()) == {"ready": True}
            # ... and one in namespaces of its own, through the directory.
            adapter = NamespacedServer.__new__(NamespacedServer)
            adapter.socket_dir, adapter.state_dir = sockets, state
            engine = NamespacedEngine(adapter, "contained",
                                      private_dir(root / "home", NOBODY), python)
            try:
                assert engine.roundtrip(2) == {"hit": 64, "exact": True}
                beside.stdin.write(json.dumps({"op": "roundtrip", "seed": 3}) + "\n")
                beside.stdin.flush()
                assert json.loads(beside.stdout.readline()) == {"hit": 64, "exact": True}
            finally:
                engine.kill()
        finally:
            beside.kill()
            beside.wait()


def test_the_socket_directory_removed_while_serving_is_reported_and_engines_go_on(
        server, root, python):
    engine = NamespacedEngine(server, "engine", private_dir(root / "home", NOBODY), python)
    try:
        assert engine.roundtrip(1)["exact"]
        shutil.rmtree(server.socket_dir)
        deadline = time.monotonic() + 60
        while "was removed or replaced while serving" not in server.log_text():
            assert time.monotonic() < deadline, server.log_text()[-3000:]
            time.sleep(0.2)
        # The engine's connection was open: it goes on storing and loading.
        assert engine.roundtrip(2) == {"hit": 64, "exact": True}
        assert server.proc is not None and server.proc.poll() is None
    finally:
        engine.kill()


def test_a_process_of_a_third_namespace_without_a_credential_gets_nothing(server, python):
    public = json.loads((server.state_dir / "server-curve.json").read_text())["public"]
    results = attack(server, python, "no_credential", {"server_public": public})
    assert results["client_api"].startswith("AuthenticationFailed"), results
    assert results["random_curve_key"] == "no reply", results
    assert "refused this credential" in results["handover_guessed_token"], results
    assert server.stats()["registered_engines"] == 0


def test_a_peer_in_another_pid_namespace_claiming_a_pid_is_refused(server, root, python):
    home = private_dir(root / "home", NOBODY)
    add_credential(server, "attacker", NOBODY, home / "credential.json", tenant="evil")
    # pid 1 is the server itself in its namespace; the attacker's own pid is 1 in its.
    results = attack(server, python, "claim_pid", {"credentials": "/tmp/home/credential.json",
                                           "claim": 1}, home)
    assert results["claim_reported_pid"] == "0", results
    assert "claims engine pid 1" in results["claim"], results
    # The control: the same registration claiming what the handover reported is served.
    assert results["reported"].startswith("ok"), results


def test_a_handover_from_a_process_that_has_exited_is_refused(server, root, python):
    home = private_dir(root / "home", NOBODY)
    add_credential(server, "attacker", NOBODY, home / "credential.json")
    results = attack(server, python, "exited_peer", {"credentials": "/tmp/home/credential.json"},
                     home)
    assert "has exited" in results["handover_after_exit"], results
    assert server.stats()["registered_engines"] == 0


@pytest.mark.parametrize("case", ["another uid's", "writable by others"])
def test_the_server_refuses_a_socket_directory_another_uid_owns_or_may_write(root, case):
    sockets = root / "sockets"
    sockets.mkdir()
    if case == "another uid's":
        os.chown(sockets, NOBODY, NOBODY)
        sockets.chmod(0o755)
    else:
        sockets.chmod(0o777)
    before = os.stat(sockets)
    state = root / "state"
    state.mkdir(mode=0o700)
    done = subprocess.run([sys.executable, "-m", "kvdepot.cli", "serve", "--port",
                           str(free_port()), "--l1-size", "64MiB", "--state-dir", str(state),
                           "--socket-dir", str(sockets)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    expected = "belongs to uid 65534" if case == "another uid's" else "is writable by others"
    assert expected in done.stderr, done.stderr[-2000:]
    after = os.stat(sockets)
    assert (after.st_uid, after.st_mode) == (before.st_uid, before.st_mode)
    assert list(sockets.iterdir()) == []


SQUATTER = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.bind("/tmp/sockets/handover.sock")
sock.listen(1)
print("listening", flush=True)
conn, _ = sock.accept()
conn.settimeout(10)
data, fds, _, _ = socket.recv_fds(conn, 4096, 16)
print(json.dumps({"bytes": len(data), "fds": len(fds)}), flush=True)
"""


VICTIM = """
import os
from kvdepot.client.memory_handover import hand_over_to
from kvdepot.errors import AuthenticationFailed
from kvdepot.protocol import Pong
from kvdepot.rpc.credentials import Credential
# What a PING reply of the real server (pid 1 of its namespace, uid 0) says.
server = Pong("boot", "@kvdepot-handover-gone", 1, 0, "handover.sock")
try:
    hand_over_to(server, Credential(name="owner", token="the-real-token"),
                 [os.memfd_create("kv")], 10, "ipc:///tmp/sockets/kvdepot.sock")
    print("sent", flush=True)
except AuthenticationFailed as exc:
    print("refused:", exc, flush=True)
"""


@pytest.mark.parametrize("squatter_uid", [NOBODY, 0])
def test_a_worker_hands_nothing_to_a_socket_another_user_could_have_put_there(
        root, squatter_uid, python):
    """A directory anyone may write (the server would refuse it; here nobody checked it):
    a squatter of another PID namespace binds the handover name, and a worker of a third
    one, which sees no pid of either, hands over to it. A squatter of another uid shows
    its uid; one of the server's own uid (another container's root) cannot have been put
    there by the server's uid alone, which the directory's mode shows."""
    sockets = root / "sockets"
    sockets.mkdir()
    sockets.chmod(0o1777)
    binds = {"sockets": sockets, "python": python}
    command = isolated([PYTHON, "-c", SQUATTER], binds,
                       uid=squatter_uid if squatter_uid else None)
    squatter = start(command, root / "squatter.log", stdout=subprocess.PIPE)
    try:
        assert squatter.stdout is not None
        assert squatter.stdout.readline().strip() == b"listening"
        victim = subprocess.run(isolated([PYTHON, "-c", VICTIM], binds, workdir=WORKDIR),
                                capture_output=True, text=True, timeout=120)
        assert victim.stdout.startswith("refused:"), victim.stdout + victim.stderr[-2000:]
        assert "sent it nothing" in victim.stdout
        got = json.loads(squatter.stdout.readline())
        assert got == {"bytes": 0, "fds": 0}
    finally:
        stop(squatter)


def test_a_second_server_refuses_the_socket_directory_a_live_one_serves(server, root):
    state = root / "second-state"
    state.mkdir(mode=0o700)
    done = subprocess.run([sys.executable, "-m", "kvdepot.cli", "serve", "--port",
                           str(free_port()), "--l1-size", "64MiB", "--state-dir", str(state),
                           "--socket-dir", str(server.socket_dir)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "another server listens on" in done.stderr, done.stderr[-2000:]
    # The first one still serves through its sockets.
    assert server.stats()["registered_engines"] == 0
