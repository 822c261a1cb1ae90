"""A redis-py connection that sends values from the caller's memory, not from a copy.

With hiredis installed, redis-py packs every command with hiredis's packer, which turns
each argument into `bytes` and joins the command into one `bytes`: a SET of a 4 MiB piece
was copied twice before it reached the socket, and those copies were most of the shared
tier's write-behind time. redis-py's own Python packer keeps `memoryview` arguments (and
any argument above its buffer cutoff) as separate parts that `sendall` reads in place, so
this connection uses that packer; replies are still parsed by hiredis. No protocol code
of ours: only the choice of redis-py's packer.
"""

from __future__ import annotations

from typing import Any

from redis.connection import Connection, PythonRespSerializer


class ZeroCopyConnection(Connection):
    """A plain TCP connection (TLS keeps redis-py's `SSLConnection` and its packer)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._command_packer = PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)
