"""Issue 45: the HTTP listeners (admin API, metrics) against another local user.

Measured before: uid 65534 without a credential held 24,000 idle connections to the
admin port, each with half a request line; the server sat at its descriptor limit and a
new engine could not connect, while /healthz still answered 200. Each bound of
`kvdepot.server.http_bounds` is shown here against a real server, with the attacker
running as another uid through setpriv (tests/support/http_flood.py).
"""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request

import pytest

from kvdepot.server.http_bounds import (
    KEEP_ALIVE_S,
    MAX_BODY_BYTES,
    REQUEST_DEADLINE_S,
    HttpBounds,
)
from kvdepot.server.readiness import ACCEPT_PROBE_S, EngineReadiness, engine_reserve
from tests.support.as_user import NOBODY
from tests.support.http_attack import HeldConnections, hostile_request, http_server
from tests.support.server import free_port, stats
from tests.support.waiting import wait_until

LIMIT = 1024
"""The servers' descriptor limit here: 32 HTTP connections in all, 8 per peer."""
BOUNDS = HttpBounds(LIMIT)
SLACK_S = 20.0
"""Room on top of a deadline before a test calls it missed (a loaded 2-core machine)."""


def test_each_peer_is_bounded_over_both_listeners_and_refusals_are_counted(state_dir):
    srv = http_server(LIMIT)
    srv.server.start()
    flood = HeldConnections([srv.admin_port, srv.metrics_port], 200)
    try:
        flood.connected()
        assert flood.held >= 100, f"the attacker connected only {flood.held} times"
        # Past its bound every connection of the attacker is reset as it is accepted,
        # counted as refused for its peer (not for the bound of all peers).
        wait_until(lambda: flood.closed() >= flood.held - BOUNDS.per_peer,
                   "the server resetting the connections past the per-peer bound",
                   timeout=REQUEST_DEADLINE_S + SLACK_S)
        counters = stats(srv.server.url)
        assert counters["http_connections_refused_peer"] >= flood.held - BOUNDS.per_peer
        assert counters["http_connections_refused_all_peers"] == 0
        # The server's own user is served on both listeners, and the server is ready.
        assert srv.get(srv.admin_port, "/healthz")[0] == 200
        assert srv.get(srv.metrics_port, "/metrics")[0] == 200
        assert srv.readyz()[0] == 200
        # What the attacker held within its bound is reset by the request deadline.
        wait_until(lambda: flood.closed() == flood.held,
                   "the server ending every half-sent request",
                   timeout=REQUEST_DEADLINE_S + SLACK_S)
        assert stats(srv.server.url)["http_requests_timed_out"] >= BOUNDS.per_peer
    finally:
        flood.stop()
        srv.server.stop()


def test_all_peers_together_are_bounded(state_dir):
    """Five users each within the bound per peer: together they pass the bound for all."""
    srv = http_server(LIMIT)
    srv.server.start()
    users = [NOBODY - i for i in range(BOUNDS.total // BOUNDS.per_peer + 1)]
    floods = [HeldConnections([srv.admin_port, srv.metrics_port], BOUNDS.per_peer, uid=uid,
                              again=True) for uid in users]
    try:
        for flood in floods:
            flood.connected()
        wait_until(lambda: stats(srv.server.url)["http_connections_refused_all_peers"] > 0,
                   "a connection refused for the bound of all peers",
                   timeout=REQUEST_DEADLINE_S + SLACK_S)
        assert stats(srv.server.url)["http_connections_refused_peer"] == 0
    finally:
        for flood in floods:
            flood.stop()
        srv.server.stop()


def test_slow_huge_and_idle_requests_are_cut_off(state_dir):
    srv = http_server()
    srv.server.start()
    try:
        slow = hostile_request(srv.admin_port, "slow")
        assert slow["ended"] and slow["status"] == 0, slow
        assert REQUEST_DEADLINE_S - 0.5 <= slow["lived"] < REQUEST_DEADLINE_S + SLACK_S, slow

        for port in (srv.admin_port, srv.metrics_port):
            headers = hostile_request(port, "headers")
            assert headers["ended"] and headers["status"] == 400, headers
        body = hostile_request(srv.admin_port, "body")
        assert body["ended"] and body["status"] == 413, body
        chunked = hostile_request(srv.admin_port, "chunked")
        assert chunked["ended"] and chunked["status"] == 411, chunked

        idle = hostile_request(srv.admin_port, "keepalive")
        assert idle["ended"] and idle["status"] == 200, idle
        assert KEEP_ALIVE_S - 0.5 <= idle["lived"] < KEEP_ALIVE_S + SLACK_S, idle

        counters = stats(srv.server.url)
        assert counters["http_requests_timed_out"] == 1
        assert counters["http_requests_refused"] == 4
        # A body within the cap still reaches the API (an anonymous change: 401).
        request = urllib.request.Request(
            f"http://127.0.0.1:{srv.admin_port}/v1/log-level", method="PUT",
            data=b'{"level": "INFO"}' + b" " * (MAX_BODY_BYTES - 17))
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 401
    finally:
        srv.server.stop()


def test_readyz_fails_while_descriptors_for_new_engines_are_gone(state_dir):
    """Descriptors parked in handover tickets (a credential holder's, 30 s each) take the
    server under the reserve kept for new engines: /readyz says so, /healthz does not."""
    from kvdepot.client.memory_handover import hand_over
    from kvdepot.protocol import RequestType
    from kvdepot.rpc.connection import DepotConnection

    limit = 200
    srv = http_server(limit)
    srv.server.start()
    memory = os.memfd_create("kvdepot-readyz")
    conn = DepotConnection(srv.server.url)
    try:
        assert srv.readyz()[0] == 200
        pong = conn.call(RequestType.PING, timeout=30)
        hand_over(pong, conn.credential, [memory] * (limit - engine_reserve(limit)), 30)
        wait_until(lambda: srv.readyz()[0] == 503, "/readyz failing", timeout=SLACK_S)
        status, answer = srv.readyz()
        assert status == 503 and "descriptors" in answer["reason"], answer
        assert srv.get(srv.admin_port, "/healthz")[0] == 200  # alive all along
        # The unclaimed ticket expires (30 s), its descriptors are closed: ready again.
        wait_until(lambda: srv.readyz()[0] == 200, "/readyz recovering", timeout=90)
    finally:
        conn.close()
        os.close(memory)
        srv.server.stop()


def test_readiness_fails_when_the_request_socket_does_not_greet(state_dir):
    """The accept probe against a real server (greets), a listener that never accepts
    (a stalled accept loop: the kernel completes the handshake, nobody greets) and a port
    nobody listens on."""
    import asyncio

    srv = http_server()
    srv.server.start()
    stalled = socket.create_server(("127.0.0.1", 0))
    try:
        limit = 1 << 16
        ready = EngineReadiness(srv.server.url, limit)
        assert asyncio.run(ready.reason_not_ready()) is None
        not_accepting = EngineReadiness(f"tcp://127.0.0.1:{stalled.getsockname()[1]}", limit)
        reason = asyncio.run(not_accepting.reason_not_ready())
        assert reason is not None and f"within {ACCEPT_PROBE_S:g} s" in reason, reason
        nobody = EngineReadiness(f"tcp://127.0.0.1:{free_port()}", limit)
        reason = asyncio.run(nobody.reason_not_ready())
        assert reason is not None and "cannot connect" in reason, reason
    finally:
        stalled.close()
        srv.server.stop()
