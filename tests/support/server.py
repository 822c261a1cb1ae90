"""The integration tests' server: the shared `ServerProcess` with small test sizes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvdepot.server_process import ServerProcess, free_port

__all__ = ["free_port", "running_server", "small_server"]

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
