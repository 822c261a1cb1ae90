"""The integration tests' server: the shared `ServerProcess` with small test sizes, and
the questions tests ask a running one over connections of their own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvdepot.client.admin import AdminClient
from kvdepot.protocol import KeyScope, Lookup, Pong, QueryPrefetchStatus, RequestType, pack_ints
from kvdepot.rpc.connection import DepotConnection
from kvdepot.server_process import ServerProcess, free_port

__all__ = ["free_port", "lookup_answered_later", "running_server", "server_pong",
           "small_server", "stats"]

TEST_CHUNK_SIZE = 64
TEST_L1_SIZE = "256MiB"


def small_server(**options: Any) -> ServerProcess:
    """A server (not started yet) with the tests' chunk and memory sizes unless given."""
    options.setdefault("chunk_size", TEST_CHUNK_SIZE)
    options.setdefault("l1_size", TEST_L1_SIZE)
    return ServerProcess(**options)


@contextmanager
def running_server(**options: Any) -> Iterator[ServerProcess]:
    with small_server(**options) as server:
        yield server


def stats(url: str) -> dict[str, float]:
    """The server's STATS counters, over an admin connection opened for this one call."""
    with AdminClient(url) as admin:
        return admin.stats()


def server_pong(url: str, timeout: float) -> Pong:
    """The server's PING reply (its handover socket, pid, uid), to a new client of this
    user with a connection of its own."""
    conn = DepotConnection(url)
    try:
        return conn.call(RequestType.PING, timeout=timeout)
    finally:
        conn.close()


def lookup_answered_later(conn: DepotConnection, request_id: str, tokens: list[int]) -> int:
    """The chunks a LOOKUP of `tokens` (model test-model) hits when they are found only in
    a lower tier: the LOOKUP reply cannot know the count yet, so it must be None, and
    QUERY_PREFETCH_STATUS answers once that tier has been read."""
    lookup = Lookup(request_id, KeyScope("test-model", 1), pack_ints(tokens), 1)
    assert conn.submit(RequestType.LOOKUP, lookup).result(30) is None
    deadline = time.monotonic() + 30
    while (n := conn.submit(RequestType.QUERY_PREFETCH_STATUS,
                            QueryPrefetchStatus(request_id)).result(30)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return n
