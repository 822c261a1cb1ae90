"""Issue 45's goal: one unauthenticated local user floods every listener at once, and the
engines do not notice.

The attacker is uid 65534 through setpriv, without a credential: two processes keep up
to 24,000 idle connections with half a request line on the admin and metrics ports
(each one the server ends is replaced at once), a third holds 2,048 raw connections to
the request socket that never handshake, and a fourth sends slow, oversized and
bodiless-chunked requests in a loop. Meanwhile a registered engine PINGs and new
engines connect and register. The goal is a new engine registered within 1 s, PING p99
at or below 50 ms, nothing registered dropped; the test prints what it measured
(`pytest -s`) and asserts generous bounds (this machine may be loaded by other work),
plus the structural facts: no registration dropped, every refusal counted.
"""

from __future__ import annotations

import subprocess
import threading
import time

import numpy as np
import torch

from kvdepot.protocol import RequestType
from kvdepot.rpc.connection import DepotConnection
from tests.support.as_user import NOBODY, python_as_user
from tests.support.http_attack import HeldConnections, http_server
from tests.support.raw_registration import register
from tests.support.server import stats

IDLE_PER_PROCESS = 12_000
RAW_ZMQ = 2_048
PINGS = 2_000
NEWCOMERS = 5
GENEROUS_REGISTRATION_S = 10.0
"""Asserted bound on one registration (the goal, 1 s, is what the test prints)."""
GENEROUS_P99_S = 0.5
"""Asserted bound on PING p99 (the goal is 50 ms)."""


def _hostile_requests(port: int, stop: threading.Event) -> None:
    """Another user's slow, huge and chunked requests, one after another, until `stop`."""
    while not stop.is_set():
        for kind in ("headers", "body", "chunked"):
            subprocess.run(python_as_user("tests.support.http_flood", "request", str(port),
                                          kind), capture_output=True, timeout=120)


def _caches() -> dict[str, torch.Tensor]:
    return {"l0": torch.ones(64, 2, 16, 16)}


def test_one_users_flood_of_every_listener_leaves_engines_unaffected(state_dir):
    srv = http_server()
    srv.server.start()
    live = DepotConnection(srv.server.url)
    register(live, _caches())
    ports = [srv.admin_port, srv.metrics_port]
    floods = [HeldConnections(ports, IDLE_PER_PROCESS, again=True) for _ in range(2)]
    raw = subprocess.Popen(python_as_user("tests.support.descriptor_flood",
                                          str(srv.server.port), str(RAW_ZMQ)),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stop = threading.Event()
    hostile = threading.Thread(target=_hostile_requests, args=(srv.admin_port, stop),
                               daemon=True)
    newcomers: list[DepotConnection] = []
    try:
        for flood in floods:
            flood.connected()
        assert raw.stdout is not None
        raw_held = raw.stdout.readline()
        hostile.start()
        # The flood is in full swing: every attacker has made its connections.
        pings = []
        for _ in range(PINGS):
            started = time.perf_counter()
            live.call(RequestType.PING, timeout=30)
            pings.append(time.perf_counter() - started)
        registrations = []
        for _ in range(NEWCOMERS):
            started = time.perf_counter()
            conn = DepotConnection(srv.server.url)
            newcomers.append(conn)
            register(conn, _caches())
            registrations.append(time.perf_counter() - started)
        ready = srv.readyz()
        counters = stats(srv.server.url)
        p50, p99 = np.percentile(pings, [50, 99])
        print(f"\nflood of every listener by uid {NOBODY}: idle HTTP connections held "
              f"{[f.held for f in floods]}, raw ZeroMQ {raw_held.strip()}; "
              f"PING p50 {p50 * 1e3:.2f} ms p99 {p99 * 1e3:.2f} ms max "
              f"{max(pings) * 1e3:.2f} ms over {PINGS}; new engine connect+register "
              f"{', '.join(f'{t * 1e3:.0f}' for t in registrations)} ms; "
              f"HTTP refused per peer {counters['http_connections_refused_peer']:.0f}, "
              f"timed out {counters['http_requests_timed_out']:.0f}, refused requests "
              f"{counters['http_requests_refused']:.0f}; /readyz {ready[0]}")
        assert max(registrations) < GENEROUS_REGISTRATION_S, registrations
        assert p99 < GENEROUS_P99_S, p99
        assert counters["reaped_engines"] == 0
        assert counters["registered_engines"] == 1 + NEWCOMERS
        assert counters["http_connections_refused_peer"] > 0
        assert ready[0] == 200, ready
        live.call(RequestType.PING, timeout=30)
    finally:
        stop.set()
        for flood in floods:
            flood.stop()
        if raw.stdin is not None:
            raw.stdin.close()
        raw.wait(60)
        hostile.join(180)
        for conn in [live, *newcomers]:
            conn.close()
        srv.server.stop()
