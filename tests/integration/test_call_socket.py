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
