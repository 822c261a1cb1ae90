"""The admin API's answers while the server starts, while its control loop runs, and when
the loop is wedged: the Starlette app in process, with a real RouterServer (bound to a
free port) whose loop runs in a thread, or never."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from kvdepot.options import Options
from kvdepot.rpc.auth import ServerAuth
from kvdepot.rpc.router import RouterServer
from kvdepot.server import admin_api
from kvdepot.server.admin_api import AdminState, build_app
from kvdepot.testbed.server_process import free_port


@pytest.fixture
def state() -> AdminState:
    return AdminState(Options(), ServerAuth("null", None))


@pytest.fixture
def router() -> Iterator[RouterServer]:
    server = RouterServer(f"tcp://127.0.0.1:{free_port()}")
    yield server
    server.stop()


def test_a_starting_server_is_alive_but_not_ready(state):
    client = TestClient(build_app(state))
    assert client.get("/healthz").json()["status"] == "starting"
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["reason"] == "the server is starting"
    assert client.get("/v1/status").status_code == 503


def test_a_running_loop_answers_and_a_wedged_one_fails_liveness(state, router, depot,
                                                                monkeypatch):
    monkeypatch.setattr(admin_api, "LOOP_TIMEOUT", 0.3)
    state.router, state.depot = router, depot
    client = TestClient(build_app(state))
    # The loop is not running: requests handed to it are never run.
    wedged = client.get("/healthz")
    assert wedged.status_code == 503 and "did not answer" in wedged.json()["error"]
    assert client.get("/readyz").status_code == 503
    loop = threading.Thread(target=router.run, args=(depot,), daemon=True)
    loop.start()
    try:
        assert client.get("/healthz").json()["status"] == "ok"
        assert client.get("/readyz").json()["ready"] is True
        status = client.get("/v1/status").json()
        assert status["tiers"][0]["capacity_bytes"] == depot.tier.capacity
        depot.begin_drain()
        draining = client.get("/readyz")
        assert draining.status_code == 503 and draining.json()["reason"] == "draining"
        assert client.get("/v1/status").json()["draining"] is True
    finally:
        router.stop()
        loop.join(5)
    # After the loop ended, work handed to it is cancelled at once, not left waiting.
    assert router.call_in_loop(lambda: 1).cancelled()


def test_call_in_loop_runs_on_the_loop_thread_and_returns_errors(router, depot):
    loop = threading.Thread(target=router.run, args=(depot,), daemon=True)
    loop.start()
    try:
        assert router.call_in_loop(threading.current_thread).result(5) is loop
        failing = router.call_in_loop(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result(5)
        futures = [router.call_in_loop(lambda i=i: i) for i in range(1000)]
        assert [f.result(5) for f in futures] == list(range(1000))
    finally:
        router.stop()
        loop.join(5)
