"""Attacks on a kvdepot server from another local user, run as a child process.

CI runs as root, so the child imports what it needs and then drops to uid/gid 65534
(nobody) before it attacks: from then on it has exactly an unprivileged user's rights
(it cannot read root's ~/.kvdepot, nor open root's 0600 files). It prints one JSON
object, attack name -> what happened ("no reply", "ok: ...", "Error: message"), for
the test to judge.

  python -m tests.support.attacker anonymous ARGS_JSON   # no credential at all
  python -m tests.support.attacker tenant ARGS_JSON      # holds a tenant credential
  python -m tests.support.attacker hog_handover ARGS_JSON  # holds handover connections
  python -m tests.support.attacker replay_token ARGS_JSON  # holds a token a squatter got
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (imported lazily by getaddrinfo: unreadable after the drop)
import faulthandler
import json
import os
import socket
import struct
import sys
import traceback
from typing import Any

import msgspec
import numpy as np
import zmq

from kvdepot.client.admin import AdminClient
from kvdepot.errors import KVDepotError
from kvdepot.integrations.vllm.mp_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
)
from kvdepot.rpc.connection import DepotConnection
from tests.support.layouts import make_kv_caches

NOBODY = 65534
REPLY_WAIT_MS = 1500
_HEADER = struct.Struct("<IH")
_REPLY = struct.Struct("<IB")
PING, LOOKUP, REGISTER_KV_CACHE, STORE, RETRIEVE, UNREGISTER, CLEAR, STATS = (
    2, 3, 8, 10, 11, 9, 12, 13)


def drop_privileges() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    assert os.getuid() == NOBODY and os.geteuid() == NOBODY


def outcome(fn: Any) -> str:
    try:
        return f"ok: {fn()!r}"[:300]
    except (KVDepotError, ConnectionError, TimeoutError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"[:300]


# ---- raw ZeroMQ: what any local process can send -----------------------------------------
def raw_call(url: str, request_type: int, payload: Any, **options: Any) -> str:
    """Send one request on a fresh socket; the reply's status, or 'no reply'."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        setattr(sock, name, value)
    sock.connect(url)
    try:
        sock.send_multipart([_HEADER.pack(1, request_type), msgspec.msgpack.encode(payload)])
        if not sock.poll(REPLY_WAIT_MS):
            return "no reply"
        header, body = sock.recv_multipart()
        status = _REPLY.unpack(header)[1]
        return f"reply: status {status} {body[:120]!r}"
    finally:
        sock.close(linger=0)


def proc_fd_registration(pid: int, fd: int, nbytes: int) -> list[Any]:
    """REGISTER_KV_CACHE as the server used to take it: memory named as /proc/<pid>/fd/<fd>,
    one layer of `nbytes` bytes in blocks of 16 tokens."""
    rows = nbytes // 16 // 256
    layer = ["l0", 0, "uint8", [rows, 16, 256], [16 * 256, 256, 1], 0, 0]
    return [12345, "m", 1, 0, 16, [["cpu", pid, fd, nbytes]], [layer], 0]


def handover_attempt(address: str, token: str) -> str:
    """Connect to the server's handover socket (its name is visible in /proc/net/unix;
    the test names the one of its server, as other servers may run on the host) and hand
    over a file with a guessed token."""
    with open("/proc/net/unix") as f:
        names = [line.split()[-1] for line in f if "@kvdepot-handover-" in line]
    if address not in names:
        return "no handover socket"
    names = [address]
    memfd = os.memfd_create("attacker")
    os.ftruncate(memfd, 4096)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(5)
        sock.connect("\0" + names[0][1:])
        socket.send_fds(sock, [msgspec.msgpack.encode(["owner", token])], [memfd])
        return f"reply: {msgspec.msgpack.decode(sock.recv(4096))!r}"[:300]


def anonymous(args: dict[str, Any]) -> dict[str, str]:
    url = args["url"]
    lookup = ["r", [args["model"], 1, ""], np.asarray(args["tokens"], "<i4").tobytes(), 1]
    results = {
        "ping": raw_call(url, PING, []),
        "lookup": raw_call(url, LOOKUP, lookup),
        "clear": raw_call(url, CLEAR, []),
        "stats": raw_call(url, STATS, []),
        "register_root_file_via_proc": raw_call(
            url, REGISTER_KV_CACHE, proc_fd_registration(args["secret_pid"], args["secret_fd"],
                                                        args["secret_bytes"])),
        "guessed_plain_token": raw_call(url, PING, [], plain_username=b"owner",
                                        plain_password=b"guess"),
        "client_api": outcome(lambda: DepotConnection(url, connect_timeout=60).call(
            PING, timeout=5)),
        "handover_socket": outcome(lambda: handover_attempt(args["handover"], "guess")),
    }
    return results


# ---- with a credential of its own (another tenant) ---------------------------------------
def tenant(args: dict[str, Any]) -> dict[str, str]:
    from kvdepot.protocol import RegisterKVCache, Retrieve, Store, UnregisterKVCache, pack_ints

    url, cred, tokens = args["url"], args["credentials"], args["tokens"]
    blocks = list(range(args["chunk"] // 16))
    victim = bytes.fromhex(args["victim_id"])
    results: dict[str, str] = {}
    with AdminClient(url, timeout=10, credentials=cred) as admin:
        results["clear"] = outcome(admin.clear)
        results["stats"] = outcome(admin.stats)
    ctx = zmq.Context.instance()
    scheduler = LMCacheMPSchedulerAdapter(url, ctx, args["model"], vllm_block_size=16,
                                          mq_timeout=10, credentials=cred)
    scheduler.maybe_submit_lookup_request("steal", tokens)
    results["lookup_victim_prompt"] = outcome(lambda: scheduler.check_lookup_result("steal"))
    conn = DepotConnection(url, connect_timeout=10, credentials=cred)
    transfer = dict(instance_id=victim, request_id="x", token_ids=pack_ints(tokens), start=0,
                    end=args["chunk"], block_ids=pack_ints(blocks))
    results["store_as_victim"] = outcome(
        lambda: conn.submit(STORE, Store(**transfer)).result(10))
    results["retrieve_as_victim"] = outcome(
        lambda: conn.submit(RETRIEVE, Retrieve(**transfer)).result(10))
    results["unregister_victim"] = outcome(
        lambda: conn.submit(UNREGISTER, UnregisterKVCache(victim)).result(10))
    results["register_with_a_guessed_ticket"] = outcome(lambda: conn.submit(
        REGISTER_KV_CACHE, RegisterKVCache(
            model="m", world_size=1, rank=0, block_size=16, allocations=[], layers=[],
            engine_pid=os.getpid(), handover_ticket=os.urandom(16))).result(10))
    results["open_root_file"] = outcome(lambda: os.open(args["secret_path"], os.O_RDWR))
    # The old way in: name the victim engine's memory as /proc/<pid>/fd/<n>.
    old_style = msgspec.msgpack.encode(proc_fd_registration(args["victim_pid"], 3, 1 << 20))
    results["register_victim_memory_via_proc"] = outcome(
        lambda: conn._calls.call(REGISTER_KV_CACHE, old_style, 10))
    # Poisoning: store junk, from memory of its own in the victim's layout, under a prompt
    # the victim will store later.
    worker = LMCacheMPWorkerAdapter(url, ctx, args["model"], vllm_block_size=16,
                                    mq_timeout=10, credentials=cred)
    caches = make_kv_caches("vllm_cpu", 2, 32, 16)
    for tensor in caches.values():
        tensor.fill_(7)
    worker.register_kv_caches(caches)
    op = LoadStoreOp(token_ids=args["future_tokens"], block_ids=blocks, start=0,
                     end=args["chunk"])
    worker.submit_store_request("poison", op, None)
    results["poison_store"] = outcome(lambda: worker.store_ops["poison"][0].future.result(10))
    worker.shutdown()
    scheduler.shutdown()
    conn.close()
    return results


# ---- holding the handover socket's connections --------------------------------------------
def hog_handover(args: dict[str, Any]) -> dict[str, str]:
    """Open `connections` connections to the handover socket, report, and hold them until
    stdin closes (the server drops idle ones after a while; the test acts before)."""
    held = []
    for _ in range(args["connections"]):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(5)
        try:
            sock.connect("\0" + args["handover"][1:])
        except OSError:
            sock.close()
            break
        held.append(sock)
    print(json.dumps({"opened": str(len(held))}))
    sys.stdout.flush()
    sys.stdin.read()
    return {"opened": str(len(held))}


# ---- with a token captured from an older server (issue 27) -------------------------------
def replay_token(args: dict[str, Any]) -> dict[str, str]:
    """CLEAR and STATS with a captured token: as PLAIN, as CURVE with a keypair of its
    own (the server's public key is no secret), without anything; and the admin API's
    CLEAR with the bearer derived from the token."""
    import urllib.error
    import urllib.request

    from kvdepot.rpc.credentials import admin_bearer, token_digest

    url, name, token = args["url"], args["name"].encode(), args["token"].encode()
    public, secret = zmq.curve_keypair()
    curve = dict(curve_serverkey=args["server_public"].encode(), curve_publickey=public,
                 curve_secretkey=secret)
    results = {
        "plain_clear": raw_call(url, CLEAR, [], plain_username=name, plain_password=token),
        "plain_stats": raw_call(url, STATS, [], plain_username=name, plain_password=token),
        "curve_own_key_clear": raw_call(url, CLEAR, [], **curve),
        "curve_own_key_stats": raw_call(url, STATS, [], **curve),
        "no_credential_stats": raw_call(url, STATS, []),
    }
    bearer = admin_bearer(args["name"], token_digest(args["token"]))
    request = urllib.request.Request(args["admin_url"] + "/v1/clear", data=b"{}",
                                     method="POST", headers={
                                         "Authorization": f"Bearer {bearer}",
                                         "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            results["admin_api_clear"] = f"ok: HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        results["admin_api_clear"] = f"HTTP {exc.code}"
    except OSError as exc:
        results["admin_api_clear"] = f"{type(exc).__name__}: {exc}"
    return results


STALL_SECONDS = 180
"""Past this, the attacker prints every thread's stack and exits: a stall (once, in a
loaded full run) shows where it hung, before the test's own limit kills it silently."""


def main() -> None:
    faulthandler.dump_traceback_later(STALL_SECONDS, exit=True)
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    drop_privileges()
    try:
        results = {"anonymous": anonymous, "tenant": tenant, "hog_handover": hog_handover,
                   "replay_token": replay_token}[mode](args)
    except BaseException:
        results = {"crashed": traceback.format_exc()}
    print(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: it would import modules nobody cannot read


if __name__ == "__main__":
    main()
