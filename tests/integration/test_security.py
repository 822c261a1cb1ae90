"""Issue 9, findings 2 and 3: attacks from another local user, and between tenants.

The attacks run in a child process that drops to uid 65534 (tests/support/attacker.py);
before the change every one of them succeeded (it pinged, looked up, cleared, and
registered a root-only 0600 file read-write through /proc/<pid>/fd). Now a process
without a credential gets nothing, and one with a tenant credential gets nothing of
anyone else's.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvdepot.client.admin import AdminClient
from kvdepot.client.memory_handover import hand_over
from kvdepot.errors import AuthenticationFailed, InvalidRequest, NotRegistered, PermissionDenied
from kvdepot.protocol import RequestType, Store, pack_ints
from kvdepot.rpc.auth import add_credential, remove_credential
from kvdepot.rpc.connection import DepotConnection
from kvdepot.rpc.credentials import server_file
from kvdepot.testbed.server_process import ServerProcess
from tests.support.credentials import credential_file
from tests.support.raw_registration import FENCE, hand_over_memory, register
from tests.support.server import server_pong, small_server

CHUNK = 64
PROMPT = list(range(1000, 1000 + CHUNK + 1))
FUTURE_PROMPT = list(range(5000, 5000 + CHUNK + 1))
BLOCKS = [0, 1, 2, 3]
NO_WAIT = 300.0
NOBODY = 65534


@pytest.fixture
def secure_server(state_dir) -> Iterator[ServerProcess]:
    server = small_server(chunk_size=CHUNK).start()
    yield server
    server.stop()


def run_attacker(mode: str, **args) -> dict[str, str]:
    result = subprocess.run([sys.executable, "-m", "tests.support.attacker", mode,
                             json.dumps(args)], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert "crashed" not in outcome, outcome["crashed"]
    return outcome


def credential_for_nobody(state_dir: Path, name: str, tenant: str) -> str:
    """A tenant credential, written where uid 65534 can read it (and nobody else)."""
    directory = tempfile.mkdtemp(prefix="kvdepot-nobody-")
    os.chmod(directory, 0o755)
    path = os.path.join(directory, f"{name}.json")
    with open(path, "w") as f:
        f.write(add_credential(state_dir, name, "engine", tenant).to_json())
    os.chmod(path, 0o600)
    os.chown(path, NOBODY, NOBODY)
    return path


def handover_address(url: str) -> str:
    return server_pong(url, NO_WAIT).handover


def root_only_secret() -> tuple[str, int, str]:
    """A root-only 0600 file, held open by this process: (path, fd, its digest)."""
    fd, path = tempfile.mkstemp(prefix="kvdepot-secret-")
    os.write(fd, os.urandom(CHUNK * 16 * 256))
    os.fchmod(fd, 0o600)
    return path, fd, hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_another_user_without_a_credential_gets_nothing(secure_server, engines_at):
    victim = engines_at(secure_server.url)
    victim.fill(seed=1)
    victim.store("v", PROMPT, BLOCKS, 0, CHUNK)
    path, fd, digest = root_only_secret()
    try:
        outcome = run_attacker("anonymous", url=secure_server.url, model="test-model",
                               tokens=PROMPT, secret_pid=os.getpid(), secret_fd=fd,
                               secret_bytes=CHUNK * 16 * 256,
                               handover=handover_address(secure_server.url))
        # Not a byte back: ZAP refuses the handshake, so no request is ever read.
        for attack in ("ping", "lookup", "clear", "stats", "register_root_file_via_proc",
                       "guessed_plain_token"):
            assert outcome[attack] == "no reply", (attack, outcome[attack])
        assert outcome["client_api"].startswith("AuthenticationFailed: the kvdepot server at "
                                                f"{secure_server.url} requires a credential"
                                                ), outcome["client_api"]
        assert "refused this credential" in outcome["handover_socket"], outcome

        assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest
    finally:
        os.close(fd)
        os.unlink(path)
    with AdminClient(secure_server.url) as admin:
        assert admin.stats()["chunks"] == 1  # CLEAR did not run
    assert victim.lookup("again", PROMPT) == CHUNK
    log = secure_server.stop()
    # The ZeroMQ attempts end at the mechanism (CURVE only, on loopback too), before any
    # credential is checked: there is nothing for the ZAP handler to refuse or log.
    assert "refused a memory handover" in log, log


def test_another_user_with_a_tenant_credential_reaches_nothing_of_others(state_dir,
                                                                        secure_server,
                                                                        engines_at):
    victim = engines_at(secure_server.url)  # the owner's engine, no tenant
    victim.fill(seed=2)
    victim.store("v", PROMPT, BLOCKS, 0, CHUNK)
    secret_path, fd, _ = root_only_secret()
    os.close(fd)
    try:
        outcome = run_attacker(
            "tenant", url=secure_server.url, model="test-model", chunk=CHUNK,
            credentials=credential_for_nobody(state_dir, "mallory", "mallory"),
            tokens=PROMPT, future_tokens=FUTURE_PROMPT,
            victim_id=victim.registration_id().hex(), victim_pid=victim.proc.pid,
            secret_path=secret_path)
    finally:
        os.unlink(secret_path)
    assert outcome["clear"].startswith("PermissionDenied: CLEAR needs an admin credential")
    assert outcome["stats"].startswith("PermissionDenied: STATS needs an admin credential")
    assert outcome["lookup_victim_prompt"] == "ok: 0"
    for attack in ("store_as_victim", "retrieve_as_victim"):
        assert outcome[attack].startswith("NotRegistered: no KV cache is registered under this "
                                          "instance id on this connection"), outcome[attack]
    assert outcome["register_with_a_guessed_ticket"].startswith(
        "InvalidRequest: unknown or expired handover ticket")
    assert outcome["open_root_file"].startswith("PermissionError")
    assert outcome["register_victim_memory_via_proc"].startswith(
        "MalformedPayload: malformed REGISTER_KV_CACHE payload")
    assert outcome["poison_store"].startswith("ok: StoreResult(stored=1")  # its own scope
    # The victim is still registered, and neither reads nor stores the attacker's junk.
    assert victim.lookup("l2", FUTURE_PROMPT) == 0
    victim.store("v2", FUTURE_PROMPT, [4, 5, 6, 7], 0, CHUNK)
    assert victim.retrieve("r2", FUTURE_PROMPT, [8, 9, 10, 11], 0, CHUNK) == set()
    assert victim.retrieve("r1", PROMPT, [12, 13, 14, 15], 0, CHUNK) == set()
    for mine, loaded in ((BLOCKS, [12, 13, 14, 15]), ([4, 5, 6, 7], [8, 9, 10, 11])):
        for a, b in zip(victim.read_blocks(mine), victim.read_blocks(loaded), strict=True):
            assert torch.equal(a, b)
    with AdminClient(secure_server.url) as admin:
        assert admin.stats()["stored_chunks"] == 3  # victim twice, mallory once


def test_two_tenants_of_one_user_never_share_chunks(state_dir, secure_server, engines_at):
    credentials = {tenant: credential_file(state_dir, tenant, "engine", tenant)
                   for tenant in ("alpha", "beta")}
    alpha = engines_at(secure_server.url, credentials=credentials["alpha"])
    beta = engines_at(secure_server.url, credentials=credentials["beta"])
    owner = engines_at(secure_server.url)
    alpha.fill(seed=3)
    beta.fill(seed=4)
    salt = "same-salt"
    alpha.store("a", PROMPT, BLOCKS, 0, CHUNK, salt=salt)
    assert beta.lookup("b", PROMPT, salt=salt) == 0
    assert owner.lookup("o", PROMPT, salt=salt) == 0
    assert alpha.lookup("a2", PROMPT, salt=salt) == CHUNK
    # Beta stores first under the prompt alpha will send: alpha's store is not skipped
    # as present, and alpha loads its own bytes.
    beta.store("b2", FUTURE_PROMPT, BLOCKS, 0, CHUNK, salt=salt)
    alpha.store("a3", FUTURE_PROMPT, [4, 5, 6, 7], 0, CHUNK, salt=salt)
    assert alpha.retrieve("a3", FUTURE_PROMPT, [8, 9, 10, 11], 0, CHUNK, salt=salt) == set()
    for a, b in zip(alpha.read_blocks([4, 5, 6, 7]), alpha.read_blocks([8, 9, 10, 11]),
                    strict=True):
        assert torch.equal(a, b)
    # The same request id in two tenants: ending beta's session leaves alpha's locks
    # (the lookup after each notice is answered after it: same connection, in order).
    assert alpha.lookup("shared-id", FUTURE_PROMPT, salt=salt) == CHUNK  # a chunk "a2" left
    with AdminClient(secure_server.url) as admin:
        locked = admin.stats()["locked_chunks"]
        beta.call("scheduler", "end_session", "shared-id")
        assert beta.lookup("after-b", PROMPT, salt=salt) == 0
        assert admin.stats()["locked_chunks"] == locked
        alpha.call("scheduler", "end_session", "shared-id")
        assert alpha.lookup("after-a", [1, 2, 3], salt=salt) == 0
        assert admin.stats()["locked_chunks"] == locked - 1


def test_registration_ids_are_bound_to_the_connection_that_registered(secure_server):
    mine = DepotConnection(secure_server.url)
    other = DepotConnection(secure_server.url)  # same user, same credential
    try:
        kv = torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)
        instance_id = register(mine, {"l0": kv})
        assert len(instance_id) == 16
        slot, generation = FENCE.begin()
        store = Store(instance_id=instance_id, request_id="r", token_ids=pack_ints(PROMPT),
                      start=0, end=CHUNK, block_ids=pack_ints(BLOCKS), fence_slot=slot,
                      fence_generation=generation)
        with pytest.raises(NotRegistered):
            other.submit(RequestType.STORE, store).result(NO_WAIT)
        with pytest.raises(NotRegistered):  # the call socket is another connection too
            mine.call(RequestType.STORE, store, timeout=NO_WAIT)
        assert mine.submit(RequestType.STORE, store).result(NO_WAIT).stored == 1
    finally:
        mine.close()
        other.close()
    log = secure_server.stop()
    assert instance_id.hex() not in log and "registered engine #1" in log


def test_a_worker_registers_again_by_itself_after_not_registered(secure_server, engines_at):
    engine = engines_at(secure_server.url)
    engine.fill(seed=5)
    first = engine.registration_id()
    engine.drop_registration_behind_its_back()
    engine.store("lost", PROMPT, BLOCKS, 0, CHUNK)  # NotRegistered: reported, not stored
    deadline = time.monotonic() + 60
    while engine.registration_id() == first and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.registration_id() != first
    while engine.healthy() != (True, True) and time.monotonic() < deadline:
        time.sleep(0.1)
    engine.store("again", PROMPT, BLOCKS, 0, CHUNK)
    assert engine.lookup("hit", PROMPT) == CHUNK
    log = secure_server.stop()
    assert "replaces engine #1" in log


def test_handover_checks_the_peer_and_the_files(secure_server):
    conn = DepotConnection(secure_server.url)
    try:
        kv = {"l0": torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)}
        request, _ = hand_over_memory(conn, kv)
        request.engine_pid = 1
        with pytest.raises(InvalidRequest, match="the kernel reported pid"):
            conn.submit(RequestType.REGISTER_KV_CACHE, request).result(NO_WAIT)
        request.engine_pid = os.getpid()
        with pytest.raises(InvalidRequest, match="unknown or expired handover ticket"):
            conn.submit(RequestType.REGISTER_KV_CACHE, request).result(NO_WAIT)  # used up
        server = conn.call(RequestType.PING, timeout=NO_WAIT)
        for opened in (lambda: os.open(sys.executable, os.O_RDONLY),
                       lambda: os.open(tempfile.mkstemp()[1], os.O_RDWR)):
            fd = opened()
            request.handover_ticket = hand_over(server, conn.credential, [fd, FENCE.fd],
                                                NO_WAIT)
            os.close(fd)
            with pytest.raises(InvalidRequest, match="not an unlinked shared-memory file"):
                conn.submit(RequestType.REGISTER_KV_CACHE, request).result(NO_WAIT)
    finally:
        conn.close()


def test_another_user_cannot_take_every_handover_connection(secure_server):
    """Any local user can connect to the handover socket; one holding every connection
    it can get must leave room for the server's own user's workers."""
    server = server_pong(secure_server.url, NO_WAIT)
    hog = subprocess.Popen([sys.executable, "-m", "tests.support.attacker", "hog_handover",
                            json.dumps({"handover": server.handover, "connections": 64})],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout is not None
        assert json.loads(hog.stdout.readline())["opened"] != "0"
        conn = DepotConnection(secure_server.url)
        try:  # a worker of the server's user hands its memory over meanwhile
            ticket = hand_over(server, conn.credential, [FENCE.fd], NO_WAIT)
        finally:
            conn.close()
        assert len(ticket) == 16
    finally:
        assert hog.stdin is not None
        hog.stdin.close()
        hog.wait(60)


def test_a_removed_credential_stops_working_on_open_connections(state_dir, secure_server):
    path = credential_file(state_dir, "temp", "admin", "")
    with AdminClient(secure_server.url, credentials=path) as admin:
        assert admin.stats()["chunks"] == 0
        assert remove_credential(state_dir, "temp")
        with pytest.raises(PermissionDenied, match="revoked"):
            for _ in range(100):  # the server re-reads the directory within a second
                admin.stats()
                time.sleep(0.05)
    with pytest.raises(AuthenticationFailed, match="refused the credential 'temp'"):
        AdminClient(secure_server.url, credentials=path)


def test_a_credential_added_again_under_a_removed_ones_name_revokes_the_old(
        state_dir, secure_server):
    old = state_dir / "old.cred"
    old.write_text(add_credential(state_dir, "reused", "admin", "").to_json())
    with AdminClient(secure_server.url, credentials=str(old)) as admin:
        assert admin.stats()["chunks"] == 0
        assert remove_credential(state_dir, "reused")
        add_credential(state_dir, "reused", "admin", "")  # a new token, for someone else
        with pytest.raises(PermissionDenied, match="revoked"):
            for _ in range(100):  # the server re-reads the directory within a second
                admin.stats()
                time.sleep(0.05)


def test_on_loopback_the_server_speaks_curve_with_its_key_pinned_by_the_owner(
        state_dir, secure_server):
    """Loopback is no exception: the owner credential pins the server's public key (the
    keypair file is 0600 in the 0700 state directory), and a client speaking PLAIN with the
    owner's own token gets no reply."""
    owner = json.loads(server_file(state_dir, secure_server.url).read_text())
    assert owner["mechanism"] == "curve"
    keypair = state_dir / "server-curve.json"
    assert owner["server_public"] == json.loads(keypair.read_text())["public"]
    assert oct(keypair.stat().st_mode & 0o777) == "0o600"
    from tests.support.attacker import raw_call
    assert raw_call(secure_server.url, 13, [], plain_username=b"owner",
                    plain_password=owner["token"].encode()) == "no reply"


def test_beyond_loopback_the_server_speaks_curve_and_metrics_stay_local(state_dir):
    from tests.support.server import free_port

    metrics = free_port()
    server = small_server(chunk_size=CHUNK, extra=("--host", "0.0.0.0", "--metrics-port",
                                                    str(metrics))).start()
    try:
        owner = json.loads(server_file(state_dir, server.url).read_text())
        assert owner["mechanism"] == "curve" and owner["server_public"]
        with AdminClient(server.url) as admin:  # the owner's engines need nothing set up
            assert admin.chunk_size() == CHUNK
    finally:
        log = server.stop()
    assert "authentication: curve" in log
    assert f"Prometheus metrics on http://127.0.0.1:{metrics}/metrics" in log


def test_insecure_serves_anyone_and_says_so(state_dir):
    server = small_server(chunk_size=CHUNK, extra=("--insecure",)).start()
    try:
        outcome = run_attacker("anonymous", url=server.url, model="m", tokens=PROMPT,
                               secret_pid=0, secret_fd=0, secret_bytes=4096,
                               handover=handover_address(server.url))
        assert outcome["ping"].startswith("reply: status 0")
    finally:
        log = server.stop()
    assert "authentication is OFF (--insecure)" in log


def test_credential_files_are_private(state_dir, secure_server):
    owner = server_file(state_dir, secure_server.url)
    assert oct(owner.stat().st_mode & 0o777) == "0o600"
    assert oct(state_dir.stat().st_mode & 0o777) == "0o700"
