"""A process of another user that takes over what a killed kvdepot server held, run as a
child process by tests/integration/test_port_squat.py.

It imports what it needs, drops to uid/gid 65534 (tests.support.attacker), and then:

- binds the server's TCP port with a ROUTER offering PLAIN (`plain`: it records every
  name and password clients present, through a ZAP handler of its own that admits
  everyone) or CURVE with a keypair of its own (`curve`: it records every client key
  its ZAP handler is asked about);
- answers every request it receives as a PING, naming its own handover socket and
  claiming the real server's pid and uid (a squatter may lie about anything);
- binds the dead server's abstract handover name (and one of its own), accepts every
  connection and records what arrives: bytes and descriptors; it writes a poison
  pattern into any descriptor it gets, as the issue's squatter wrote into an engine's KV.

It prints {"ready": "1"} once every socket is bound, keeps going until its stdin
closes, then prints one JSON object of what it saw and exits.

`http` instead binds a plain TCP listener on the port and records what clients send (an
admin API bearer).

  python -m tests.support.squatter plain|curve|http ARGS_JSON
"""

from __future__ import annotations

import array
import json
import mmap
import os
import select
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvdepot.protocol import ENCODER, REPLY_HEADER, REQUEST_HEADER, STATUS_OK, Pong
from tests.support.attacker import drop_privileges

POISON = b"\xa5" * 4096
ZAP = "inproc://zeromq.zap.01"


class Records:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.zap_requests: list[dict[str, Any]] = []
        self.accepted_tcp = 0
        self.handshakes_ok = 0
        self.handshakes_failed = 0
        self.requests: list[str] = []
        self.replies_sent = 0
        self.handover_connections = 0
        self.handover_bytes: list[str] = []
        self.descriptors = 0
        self.poisoned = 0

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "lock"}


def zap_handler(ctx: zmq.Context, records: Records, stop: threading.Event) -> None:
    """Admit everyone, recording what they present (a PLAIN password is the token)."""
    rep = ctx.socket(zmq.REP)
    rep.bind(ZAP)
    while not stop.is_set():
        if not rep.poll(100):
            continue
        version, request_id, _domain, _address, _, mechanism, *creds = rep.recv_multipart()
        with records.lock:
            records.zap_requests.append({"mechanism": mechanism.decode(),
                                         "credentials": [c.hex() for c in creds]})
        rep.send_multipart([version, request_id, b"200", b"OK", b"squatter", b""])
    rep.close(linger=0)


def serve_router(ctx: zmq.Context, args: dict[str, Any], mode: str, records: Records,
                 own_handover: str, stop: threading.Event) -> zmq.Socket:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    if mode == "plain":
        router.plain_server = True
    else:
        router.curve_server = True
        router.curve_secretkey = zmq.curve_keypair()[1]
    router.zap_domain = b"kvdepot"
    monitor = router.get_monitor_socket()
    router.bind(f"tcp://127.0.0.1:{args['port']}")

    def loop() -> None:
        claims = {"boot_id": "squatter", "handover": own_handover, "pid": args["claim_pid"],
                  "uid": args["claim_uid"]}
        # Only the fields this version's Pong has: the same squatter runs against old code.
        pong = Pong(**{k: v for k, v in claims.items() if k in Pong.__struct_fields__})
        while not stop.is_set():
            ready = dict(poller.poll(100))
            if monitor in ready:
                event = recv_monitor_message(monitor)["event"]
                with records.lock:
                    if event == zmq.EVENT_ACCEPTED:
                        records.accepted_tcp += 1
                    elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        records.handshakes_ok += 1
                    elif event & (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH):
                        records.handshakes_failed += 1
            if router in ready:
                frames = router.recv_multipart()
                with records.lock:
                    records.requests.append(b"|".join(frames[1:])[:200].hex())
                if len(frames) == 3 and len(frames[1]) == REQUEST_HEADER.size:
                    call_id = REQUEST_HEADER.unpack(frames[1])[0]
                    router.send_multipart([frames[0], REPLY_HEADER.pack(call_id, STATUS_OK),
                                           ENCODER.encode(pong)])
                    with records.lock:
                        records.replies_sent += 1
        monitor.close(linger=0)

    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    threading.Thread(target=loop, daemon=True).start()
    return router


def accepted(listener: socket.socket, stop: threading.Event) -> Iterator[socket.socket]:
    """Every connection `listener` accepts, until `stop` is set (checked every 0.1 s)."""
    while True:
        # A connection the kernel accepted before the stop is still yielded: a client that
        # refuses to send may have closed it before this loop's next turn.
        if not select.select([listener], [], [], 0.1)[0]:
            if stop.is_set():
                return
            continue
        yield listener.accept()[0]


def serve_handover(name: str, records: Records, stop: threading.Event) -> socket.socket:
    """Listen on the abstract name `name` (without '@') and take whatever comes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(16)

    def loop() -> None:
        for conn in accepted(listener, stop):
            with records.lock:
                records.handover_connections += 1
            conn.settimeout(2)
            try:
                fds = array.array("i")
                data, ancillary, _, _ = conn.recvmsg(4096, socket.CMSG_SPACE(253 * 4))
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(payload[:len(payload) - len(payload) % 4])
                with records.lock:
                    if data:  # an empty read is the client closing
                        records.handover_bytes.append(data[:200].hex())
                    records.descriptors += len(fds)
                for fd in fds:
                    poison(fd, records)
                conn.send(ENCODER.encode({"ticket": b"\0" * 16}))
            except OSError:
                pass
            finally:
                conn.close()

    threading.Thread(target=loop, daemon=True).start()
    return listener


def serve_http(port: int, records: Records, stop: threading.Event) -> socket.socket:
    """A TCP listener on `port` that records every byte a client sends (a bearer)."""
    listener = socket.create_server(("127.0.0.1", port))

    def loop() -> None:
        for conn in accepted(listener, stop):
            conn.settimeout(2)
            with records.lock:
                records.accepted_tcp += 1
            try:
                data = conn.recv(65536)
                if data:  # an empty read is the client closing
                    with records.lock:
                        records.requests.append(data.decode(errors="replace")[:500])
            except OSError:
                pass
            finally:
                conn.close()

    threading.Thread(target=loop, daemon=True).start()
    return listener


def poison(fd: int, records: Records) -> None:
    try:
        size = os.fstat(fd).st_size
        if size:
            with mmap.mmap(fd, size) as view:
                view[:min(size, len(POISON))] = POISON[:size]
            with records.lock:
                records.poisoned += 1
    except (OSError, ValueError):
        pass
    finally:
        os.close(fd)


def main() -> None:
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    drop_privileges()
    records = Records()
    stop = threading.Event()
    try:
        ctx = zmq.Context()
        own_handover = f"kvdepot-handover-squatter-{os.getpid()}"
        held: list[Any] = [serve_handover(own_handover, records, stop)]
        if mode == "http":
            held.append(serve_http(args["port"], records, stop))
        else:
            threading.Thread(target=zap_handler, args=(ctx, records, stop), daemon=True).start()
            if args.get("dead_handover"):
                held.append(serve_handover(args["dead_handover"].lstrip("@"), records, stop))
            held.append(serve_router(ctx, args, mode, records, "@" + own_handover, stop))
        print(json.dumps({"ready": "1"}), flush=True)
        sys.stdin.read()
        stop.set()
        time.sleep(0.5)  # the serving loops take their last turn (they poll every 0.1 s)
        result = records.as_json()
    except BaseException:
        result = {"crashed": traceback.format_exc()}
    print(json.dumps(result), flush=True)
    os._exit(0)  # no interpreter teardown: it would import modules nobody cannot read


if __name__ == "__main__":
    main()
