"""Attacks on a kvdepot server from processes in namespaces of their own (test helper).

Run inside `namespaces.isolated` as another uid (`setpriv`), with the server's socket
directory mounted at /tmp/sockets; prints one JSON object, attack -> what happened:

  python -m tests.support.ns_attacks no_credential ARGS_JSON  # knows only the directory
  python -m tests.support.ns_attacks claim_pid ARGS_JSON      # holds a credential
  python -m tests.support.ns_attacks exited_peer ARGS_JSON    # hands over after exiting
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from typing import Any

import msgspec
import torch
import zmq

from kvdepot.client.kv_export import export_kv_caches
from kvdepot.client.memory_handover import HandoverFiles, hand_over_to
from kvdepot.errors import KVDepotError
from kvdepot.protocol import ENCODER, HandoverRequest, RegisterKVCache, RequestType
from kvdepot.rpc.connection import DepotConnection
from kvdepot.rpc.credentials import Credential
from tests.support.raw_registration import FENCE

SOCKETS = "/tmp/sockets"
URL = f"ipc://{SOCKETS}/kvdepot.sock"
HANDOVER = f"{SOCKETS}/handover.sock"
REPLY_WAIT_MS = 1500
_HEADER = struct.Struct("<IH")
PING = 2


def outcome(fn: Any) -> str:
    try:
        return f"ok: {fn()!r}"[:400]
    except (KVDepotError, OSError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"[:400]


def _memfd() -> int:
    fd = os.memfd_create("attacker", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    return fd


def _raw_handover(sock: socket.socket, name: str, token: str) -> str:
    """Send a handover request with one memfd on connected `sock`; the server's answer."""
    socket.send_fds(sock, [ENCODER.encode(HandoverRequest(name=name, token=token))],
                    [_memfd()])
    return repr(msgspec.msgpack.decode(sock.recv(4096)))


def no_credential(args: dict[str, Any]) -> dict[str, str]:
    """What reaches the server with the socket directory and no credential."""

    def random_curve_key() -> str:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            args["server_public"].encode(), public, secret)
        sock.connect(URL)
        try:
            sock.send_multipart([_HEADER.pack(1, PING), msgspec.msgpack.encode([])])
            return "reply" if sock.poll(REPLY_WAIT_MS) else "no reply"
        finally:
            sock.close(linger=0)

    def guessed_token() -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(10)
            sock.connect(HANDOVER)
            return _raw_handover(sock, "owner", "guess")

    return {"client_api": outcome(lambda: DepotConnection(URL, connect_timeout=5).call(
                RequestType.PING, timeout=5)),
            "random_curve_key": random_curve_key(),
            "handover_guessed_token": outcome(guessed_token)}


def claim_pid(args: dict[str, Any]) -> dict[str, str]:
    """Hand over a KV cache with a credential, then register claiming pid `claim`; and, as
    the control, claiming the pid the handover reported."""
    conn = DepotConnection(URL, credentials=args["credentials"], connect_timeout=30)
    results = {}
    try:
        for label, claim in (("claim", args["claim"]), ("reported", None)):
            files = HandoverFiles()
            caches = {"l0": torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)}
            handles, layers, _ = export_kv_caches(caches, 16, files)
            fence = files.add(FENCE.fd, FENCE.nbytes)
            server = conn.call(RequestType.PING, timeout=30)
            handed = hand_over_to(server, conn.credential, files.fds, 30, URL)
            request = RegisterKVCache(
                model="m", world_size=1, rank=0, block_size=16, allocations=handles,
                layers=layers, engine_pid=handed.pid if claim is None else claim,
                handover_ticket=handed.ticket, fence=fence)
            results[label] = outcome(lambda r=request: conn.submit(
                RequestType.REGISTER_KV_CACHE, r).result(30).num_blocks)
            results[f"{label}_reported_pid"] = str(handed.pid)
    finally:
        conn.close()
    return results


def exited_peer(args: dict[str, Any]) -> dict[str, str]:
    """A process connects to the handover socket and exits; a child that inherited the
    connection sends the credential's real token and a memfd once its parent is reaped."""
    credential = Credential.read(args["credentials"])
    go_read, go_write = os.pipe()
    out_read, out_write = os.pipe()
    connector = os.fork()
    if connector == 0:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(HANDOVER)
        if os.fork() == 0:  # the sender: waits until the connector is gone
            os.read(go_read, 1)
            result = outcome(lambda: _raw_handover(sock, credential.name, credential.token))
            os.write(out_write, result.encode())
            os._exit(0)
        os._exit(0)
    os.waitpid(connector, 0)  # reaped: the process that connected no longer exists
    os.write(go_write, b"g")
    os.close(out_write)
    chunks = []
    while chunk := os.read(out_read, 4096):
        chunks.append(chunk)
    return {"handover_after_exit": b"".join(chunks).decode()}


def main() -> None:
    attack = {"no_credential": no_credential, "claim_pid": claim_pid,
              "exited_peer": exited_peer}[sys.argv[1]]
    print(json.dumps(attack(json.loads(sys.argv[2]))), flush=True)


if __name__ == "__main__":
    main()
