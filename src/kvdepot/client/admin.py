"""Operator and test access to a running server: ping, statistics, clearing."""

from __future__ import annotations

from types import TracebackType

import zmq

from kvdepot.protocol import RequestType
from kvdepot.rpc.connection import DepotConnection


class AdminClient:
    def __init__(self, url: str, timeout: float = 10.0, context: zmq.Context | None = None,
                 credentials: str | None = None) -> None:
        """`credentials`: a credential file (default: see `DepotConnection`); CLEAR and
        STATS need one with the admin role, such as the owner's."""
        self.timeout = timeout
        self._conn = DepotConnection(url, context, connect_timeout=timeout,
                                     credentials=credentials)

    def ping(self) -> str:
        """The server's boot id."""
        return self._conn.call(RequestType.PING, timeout=self.timeout).boot_id

    def stats(self) -> dict[str, float]:
        return dict(self._conn.call(RequestType.STATS, timeout=self.timeout).values)

    def clear(self) -> int:
        return self._conn.call(RequestType.CLEAR, timeout=self.timeout)

    def chunk_size(self) -> int:
        return self._conn.call(RequestType.GET_CHUNK_SIZE, timeout=self.timeout)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
