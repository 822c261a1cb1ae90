"""Issue 27: a process of another user takes the port (and the handover socket's name)
of a killed server while an engine stays up.

Before the fix the engine's sockets reconnected to the squatter by themselves and sent
it the owner token (PLAIN), the worker handed the squatter its KV memfd read-write, and
the captured token then ran STATS and CLEAR against the restarted server. Now the
client pins the server's CURVE key on every (re)connection, checks who holds the
handover socket, and checks who holds the admin API's port; the squatter (uid 65534,
tests/support/squatter.py) gets nothing and the engine resumes by itself once the real
server is back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from kvdepot.client.admin import AdminClient
from kvdepot.client.admin_api import AdminAPI, AdminAPIError
from kvdepot.client.memory_handover import hand_over
from kvdepot.errors import AuthenticationFailed
from kvdepot.protocol import ENCODER, Pong, Registered, RequestType, UnregisterKVCache
from kvdepot.rpc.connection import DepotConnection
from kvdepot.rpc.credentials import Credential, admin_bearer, server_file, token_digest
from kvdepot.rpc.dealer import send_request
from kvdepot.rpc.replies import decode_reply
from tests.support.multi_engine import same_bytes
from tests.support.raw_registration import FENCE, hand_over_memory
from tests.support.server import free_port, server_pong, small_server
from tests.support.waiting import wait_until

CHUNK = 64
PROMPT = list(range(3000, 3000 + CHUNK + 1))
BLOCKS = [0, 1, 2, 3]
LOADED = [8, 9, 10, 11]
ALL_BLOCKS = list(range(32))  # the test engine's default cache
WAIT = 60.0


@pytest.fixture
def thread_failures() -> Iterator[list[str]]:
    """Exceptions that end a thread of this process (a client's I/O thread)."""
    failures: list[str] = []
    previous = threading.excepthook
    threading.excepthook = lambda hook: failures.append(f"{hook.thread}: {hook.exc_value!r}")
    yield failures
    threading.excepthook = previous


def start_squatter(mode: str, **args: Any) -> subprocess.Popen[str]:
    """tests/support/squatter.py as uid 65534, once it holds everything it binds."""
    squatter = subprocess.Popen([sys.executable, "-m", "tests.support.squatter", mode,
                                 json.dumps(args)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    assert squatter.stdout is not None
    line = squatter.stdout.readline()
    assert json.loads(line) == {"ready": "1"}, line
    return squatter


def stop_squatter(squatter: subprocess.Popen[str]) -> dict[str, Any]:
    """What the squatter saw, once its stdin closes."""
    assert squatter.stdin is not None and squatter.stdout is not None
    squatter.stdin.close()
    out = squatter.stdout.read()
    squatter.wait(30)
    seen = json.loads(out.strip().splitlines()[-1])
    assert "crashed" not in seen, seen["crashed"]
    return seen


@pytest.mark.parametrize("mode", ["plain", "curve"])
def test_a_port_squatter_gets_nothing_and_the_engine_resumes_with_the_real_server(
        state_dir, engines_at, thread_failures, mode):
    """`plain`: a ROUTER offering PLAIN whose ZAP handler records every name and password
    (the old clients' token went there); `curve`: one offering CURVE with a keypair of
    its own. Both also hold the dead server's handover name and answer any request."""
    server = small_server(chunk_size=CHUNK).start()
    engine = engines_at(server.url, heartbeat_interval=0.2, mq_timeout=2.0)
    engine.fill(seed=27)
    engine.store("before", PROMPT, BLOCKS, 0, CHUNK)
    real = server_pong(server.url, WAIT)
    memory = engine.read_blocks(ALL_BLOCKS)

    server.kill()
    squatter = start_squatter(mode, port=server.port, dead_handover=real.handover,
                              claim_pid=real.pid, claim_uid=real.uid)
    try:
        wait_until(lambda: engine.healthy() == (False, False))
        time.sleep(3)  # the engine's sockets retry every 0.1-1 s meanwhile
        # Degraded: lookups miss, stores are skipped, loads fail; nothing is waited out.
        assert engine.lookup("down", PROMPT) == 0
        engine.store("down-store", PROMPT, BLOCKS, 0, CHUNK)
        assert engine.retrieve("down", PROMPT, LOADED, 0, CHUNK) == set(LOADED)
        assert engine.healthy() == (False, False)
        # A new client of the same user is refused at once, with the error (not a
        # traceback in its I/O thread).
        started = time.monotonic()
        with pytest.raises(AuthenticationFailed, match=server.url):
            DepotConnection(server.url, connect_timeout=20)
        assert time.monotonic() - started < 10
    finally:
        seen = stop_squatter(squatter)
    assert seen["accepted_tcp"] > 0, "the engine never reached the squatter: nothing tested"
    assert seen["zap_requests"] == [], "a client presented its credential to the squatter"
    assert seen["handshakes_ok"] == 0 and seen["requests"] == [] and seen["replies_sent"] == 0
    assert seen["handover_connections"] == 0 and seen["descriptors"] == 0, seen
    assert seen["poisoned"] == 0
    assert same_bytes(memory, engine.read_blocks(ALL_BLOCKS)), "the engine's KV changed"
    assert thread_failures == []

    restarted = small_server(port=server.port, chunk_size=CHUNK).start()
    try:
        wait_until(lambda: engine.healthy() == (True, True), timeout=60)
        engine.store("after", PROMPT, BLOCKS, 0, CHUNK)
        assert engine.lookup("after", PROMPT) == CHUNK
        engine.fill_value(LOADED, 0.0)
        assert engine.retrieve("after", PROMPT, LOADED, 0, CHUNK) == set()
        assert same_bytes(engine.read_blocks(BLOCKS), engine.read_blocks(LOADED))
    finally:
        log = restarted.stop()
    assert "registered engine" in log


def test_a_worker_hands_nothing_to_a_handover_socket_the_server_does_not_hold(state_dir):
    """The PING reply (authenticated) names the server's pid and uid; a socket of another
    process under the name it gave gets no token and no descriptor."""
    server = small_server(chunk_size=CHUNK).start()
    squatter = start_squatter("curve", port=free_port(), claim_pid=0, claim_uid=0)
    conn = DepotConnection(server.url)
    memfd = os.memfd_create("kv")
    os.ftruncate(memfd, 4096)
    try:
        real = conn.call(RequestType.PING, timeout=WAIT)
        assert (real.pid, real.uid) == (server.pid, os.getuid())
        elsewhere = Pong(real.boot_id, f"@kvdepot-handover-squatter-{squatter.pid}",
                         real.pid, real.uid)
        with pytest.raises(AuthenticationFailed, match=f"held by pid {squatter.pid} "
                                                        "\\(uid 65534\\)"):
            hand_over(elsewhere, conn.credential, [memfd], 10)
        # The same call to the server's own socket goes through.
        assert len(hand_over(real, conn.credential, [memfd], 10)) == 16
    finally:
        conn.close()
        seen = stop_squatter(squatter)
        server.stop()
    assert seen["handover_connections"] == 1, seen  # it reached the squatter's socket...
    assert seen["handover_bytes"] == [] and seen["descriptors"] == 0  # ...and sent nothing
    assert os.pread(memfd, 4096, 0) == bytes(4096)
    os.close(memfd)


def test_a_restarted_server_refuses_clear_and_stats_without_a_credential(state_dir):
    """The owner file of a server that spoke PLAIN (whose token may have reached a
    squatter) is replaced at the next start: the old token opens nothing, over ZeroMQ
    (PLAIN or CURVE with a key of one's own) or as an admin API bearer."""
    port, admin_port = free_port(), free_port()
    url = f"tcp://127.0.0.1:{port}"
    leaked = "leaked-token-of-a-plain-server"
    owner_file = server_file(state_dir, url)
    owner_file.parent.mkdir(mode=0o700)
    owner_file.write_text(Credential(name="owner", token=leaked, role="admin",
                                     mechanism="plain", server_uid=str(os.getuid())).to_json())
    server = small_server(port=port, chunk_size=CHUNK,
                          extra=("--admin-port", str(admin_port))).start()
    try:
        with AdminClient(url) as admin:  # the owner's processes work unchanged
            assert admin.stats()["chunks"] == 0
        owner = Credential.read(owner_file)
        assert owner.mechanism == "curve" and owner.server_public and owner.token != leaked
        result = subprocess.run(
            [sys.executable, "-m", "tests.support.attacker", "replay_token",
             json.dumps({"url": url, "name": "owner", "token": leaked,
                         "server_public": owner.server_public,
                         "admin_url": f"http://127.0.0.1:{admin_port}"})],
            capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        outcome = json.loads(result.stdout.strip().splitlines()[-1])
        assert "crashed" not in outcome, outcome["crashed"]
        for attack in ("plain_clear", "plain_stats", "curve_own_key_clear",
                       "curve_own_key_stats", "no_credential_stats"):
            assert outcome[attack] == "no reply", (attack, outcome[attack])
        assert outcome["admin_api_clear"].startswith("HTTP 40"), outcome["admin_api_clear"]
        # The server's own side of it: the bearer of the old token is refused here too.
        request = urllib.request.Request(
            f"http://127.0.0.1:{admin_port}/v1/clear", data=b"{}", method="POST",
            headers={"Authorization": f"Bearer {admin_bearer('owner', token_digest(leaked))}",
                     "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code in (401, 403)
    finally:
        log = server.stop()
    assert "refused a connection from 127.0.0.1" in log


def test_a_plain_credential_is_refused_by_the_client_with_a_clear_error(state_dir,
                                                                        thread_failures):
    server = small_server(chunk_size=CHUNK).start()
    try:
        owner = Credential.read(server_file(state_dir, server.url))
        plain = state_dir / "plain.json"
        plain.write_text(Credential(name="owner", token=owner.token, role="admin",
                                    mechanism="plain").to_json())
        with pytest.raises(AuthenticationFailed, match="no longer speaks"):
            DepotConnection(server.url, credentials=str(plain))
        wrong_key = state_dir / "wrong-key.json"
        wrong_key.write_text(Credential(
            name="owner", token=owner.token, role="admin", curve_public=owner.curve_public,
            curve_secret=owner.curve_secret,
            server_public=zmq.curve_keypair()[0].decode()).to_json())
        with pytest.raises(AuthenticationFailed, match="public key"):
            DepotConnection(server.url, credentials=str(wrong_key), connect_timeout=20)
    finally:
        server.stop()
    assert thread_failures == []


def test_the_admin_client_sends_no_bearer_to_a_squatter_of_the_admin_port(state_dir):
    admin_port = free_port()
    server = small_server(chunk_size=CHUNK, extra=("--admin-port", str(admin_port))).start()
    try:
        # The real listener (this uid) gets the bearer: a change needs it.
        AdminAPI(f"http://127.0.0.1:{admin_port}", url=server.url).set_log_level("INFO")
    finally:
        server.stop()
    squatter = start_squatter("http", port=admin_port)
    try:
        with pytest.raises(AdminAPIError, match=r"not sending the admin bearer.*uid 65534"):
            AdminAPI(f"http://127.0.0.1:{admin_port}", url=server.url).status()
    finally:
        seen = stop_squatter(squatter)
    assert seen["accepted_tcp"] == 1, seen  # it did connect...
    assert seen["requests"] == [], seen  # ...and closed without sending a byte


def raw_dealer(url: str, credential: Credential, routing_id: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.routing_id = routing_id
    credential.apply(sock, url)
    sock.connect(url)
    return sock


def raw_request(sock: zmq.Socket, request_type: RequestType, message: Any) -> Any:
    send_request(sock, 1, request_type, ENCODER.encode(message))
    assert sock.poll(WAIT * 1000), f"no reply to {request_type.name}"
    value, error = decode_reply(request_type, *sock.recv_multipart())
    if error is not None:
        raise error
    return value


def test_a_chosen_routing_id_does_not_take_over_a_departed_connections_registration(
        state_dir):
    """A client may choose any routing id, one starting with a zero byte too (what the
    ROUTER itself generates). A registration is bound to the handshake's session, which
    the server numbers, so reusing the id of a closed connection reaches nothing."""
    server = small_server(chunk_size=CHUNK).start()
    conn = DepotConnection(server.url)
    chosen = b"\0\0\0\0\x07"  # the form of the ROUTER's own ids
    try:
        request, _ = hand_over_memory(conn, {"l0": torch.zeros(8, 2, 16, 64,
                                                                dtype=torch.bfloat16)})
        first = raw_dealer(server.url, conn.credential, chosen)
        registered: Registered = raw_request(first, RequestType.REGISTER_KV_CACHE, request)
        first.close(linger=0)
        time.sleep(0.5)  # the ROUTER lets go of the id
        second = raw_dealer(server.url, conn.credential, chosen)
        # UNREGISTER answers the same either way; only the registration's owner drops it.
        raw_request(second, RequestType.UNREGISTER_KV_CACHE,
                    UnregisterKVCache(registered.instance_id))
        second.close(linger=0)
        with AdminClient(server.url) as admin:
            assert admin.stats()["registered_engines"] == 1, \
                "a connection that chose a departed connection's routing id dropped its engine"
    finally:
        conn.close()
        log = server.stop()
    assert FENCE.fd > 0 and "registered engine #1" in log
