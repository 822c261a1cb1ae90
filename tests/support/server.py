"""The integration tests' server: the shared `ServerProcess` with small test sizes, and
the questions tests ask a running one over connections of their own."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from kvdepot.client.admin import AdminClient
from kvdepot.protocol import KeyScope, Lookup, Pong, QueryPrefetchStatus, RequestType, pack_ints
from kvdepot.rpc.connection import DepotConnection
from kvdepot.testbed.server_process import ServerProcess, free_port
from tests.support import forked

__all__ = ["free_port", "lookup_answered_later", "running_server", "server_pong",
           "small_server", "stats"]

TEST_CHUNK_SIZE = 64
TEST_L1_SIZE = "256MiB"
TEST_DRAIN_TIMEOUT = "5"
"""Seconds a stopping test server waits for reads its lookups promised. Many tests stop
theirs with an engine that looked up and never loaded (no vLLM does that) still
heartbeating, which holds a drain to its deadline (20 s by default). The drain's own tests
set theirs."""


class ForkedServerProcess(ServerProcess):
    """A `ServerProcess` whose `kvdepot serve` is forked from the tests' fork server
    (tests/support/forked.py), which has imported torch already: the same server from
    `kvdepot.cli.main` on, started in a fraction of the time. The one difference from a
    user's command line: it does not re-execute itself to lower glibc's streaming-store
    threshold (a speed setting, tested on its own). A command line a test has changed (run
    under `prlimit`, for example) is started as a real subprocess."""

    def _launch(self, output: IO[bytes] | None) -> Any:
        prefix = [sys.executable, "-m", "kvdepot.cli"]
        if self.args[:3] != prefix:
            return super()._launch(output)
        return forked.start_command(self.args[3:], self.env,
                                    output.name if output is not None else None)


def small_server(**options: Any) -> ServerProcess:
    """A server (not started yet) with the tests' chunk, memory and drain sizes unless
    given."""
    options.setdefault("chunk_size", TEST_CHUNK_SIZE)
    options.setdefault("l1_size", TEST_L1_SIZE)
    extra = tuple(options.get("extra", ()))
    if "--drain-timeout" not in extra:
        options["extra"] = (*extra, "--drain-timeout", TEST_DRAIN_TIMEOUT)
    return ForkedServerProcess(**options)


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
