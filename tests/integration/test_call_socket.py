"""Blocking calls on the caller's own socket: errors at once, notices in order, no hangs."""

import logging
import os
import signal
import threading
import time

import pytest

from kvdepot.errors import InvalidRequest, ServerUnavailable
from kvdepot.protocol import EndSession, FreeLookupLocks, KeyScope, Lookup, RequestType, pack_ints
from kvdepot.rpc.connection import DepotConnection
from tests.support.server import small_server

NO_WAIT = 300.0  # an answer must come at once, never by timing out
CHUNK = 64


def test_a_call_fails_at_once_when_the_server_dies_under_it():
    server = small_server(l1_size="64MiB").start()
    conn = DepotConnection(server.url)
    try:
        assert conn.call(RequestType.GET_CHUNK_SIZE, timeout=NO_WAIT) == CHUNK
        os.kill(server.proc.pid, signal.SIGSTOP)  # the request will sit unanswered
        outcome: list[BaseException] = []

        def call() -> None:
            try:
                conn.call(RequestType.PING, timeout=NO_WAIT)
            except BaseException as exc:
                outcome.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.5)
        assert caller.is_alive(), "a stopped server answered"
        started = time.monotonic()
        server.kill()  # SIGKILL works on a stopped process: the connection drops
        caller.join(30)
        assert not caller.is_alive()
        assert isinstance(outcome[0], ServerUnavailable)
        assert time.monotonic() - started < 10
        with pytest.raises(ServerUnavailable, match="not connected"):
            conn.call(RequestType.PING, timeout=NO_WAIT)
    finally:
        conn.close()
        server.stop()


def test_a_notices_error_is_logged_and_later_calls_get_their_own_replies(caplog):
    server = small_server(l1_size="64MiB").start()
    conn = DepotConnection(server.url)
    try:
        tokens = pack_ints(list(range(5 * CHUNK)))
        conn.notify(RequestType.FREE_LOOKUP_LOCKS, FreeLookupLocks("r", 10, 5))  # bad range
        with caplog.at_level(logging.WARNING, logger="kvdepot"):
            # The notice's error reply arrives first and must not be taken for this answer.
            hit = conn.call(RequestType.LOOKUP, Lookup("r", KeyScope("m", 1), tokens, 1),
                            timeout=NO_WAIT)
            assert hit == 0
            conn.notify(RequestType.END_SESSION, EndSession("r"))
            with pytest.raises(InvalidRequest, match="readers_per_key"):
                conn.call(RequestType.LOOKUP, Lookup("r", KeyScope("m", 1), tokens, 0),
                          timeout=NO_WAIT)
        assert "FREE_LOOKUP_LOCKS failed: bad range [10, 5)" in caplog.text
    finally:
        conn.close()
        server.stop()


def test_calls_from_many_threads_each_get_their_answer():
    server = small_server(l1_size="64MiB").start()
    conn = DepotConnection(server.url)
    try:
        answers: list[int] = []

        def worker() -> None:
            for _ in range(50):
                answers.append(conn.call(RequestType.GET_CHUNK_SIZE, timeout=NO_WAIT))

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert answers == [CHUNK] * 200
    finally:
        conn.close()
        server.stop()


def test_a_notice_does_not_wait_behind_a_call_to_a_stalled_server():
    """The scheduler's notices (END_SESSION, lock releases) share the call socket with
    the heartbeat's PING; with the server stalled, that PING holds the socket for its
    whole timeout, and the engine's scheduler loop must not wait behind it."""
    from kvdepot.client.admin import AdminClient

    server = small_server(l1_size="64MiB").start()
    conn = DepotConnection(server.url)
    try:
        lookup = Lookup("held", KeyScope("m", 1, ""), pack_ints(range(3 * CHUNK)), 1)
        assert conn.call(RequestType.LOOKUP, lookup, timeout=NO_WAIT) == 0
        with AdminClient(server.url) as admin:
            assert admin.stats()["lookup_jobs"] == 1
        os.kill(server.proc.pid, signal.SIGSTOP)
        ping: list[object] = []

        def call() -> None:
            try:
                ping.append(conn.call(RequestType.PING, timeout=20))
            except BaseException as exc:
                ping.append(exc)

        pinger = threading.Thread(target=call)
        pinger.start()
        while not conn._calls._lock.locked():
            time.sleep(0.001)
        conn.notify(RequestType.END_SESSION, EndSession("held"))
        # Continued only once the notice returned: had it waited for the socket, the PING
        # would have timed out first.
        os.kill(server.proc.pid, signal.SIGCONT)
        pinger.join()
        assert not isinstance(ping[0], BaseException), ping[0]
        with AdminClient(server.url) as admin:
            deadline = time.monotonic() + 60
            while admin.stats()["lookup_jobs"] and time.monotonic() < deadline:
                time.sleep(0.02)
            assert admin.stats()["lookup_jobs"] == 0  # the queued END_SESSION arrived
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        conn.close()
        server.stop()
