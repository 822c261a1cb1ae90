"""The protocol table decides where each request type is served; the depot follows it."""

from __future__ import annotations

import pytest

from kvdepot.errors import UnknownRequestType
from kvdepot.options import DEFAULTS
from kvdepot.protocol import REQUESTS, Empty, RequestType, Served
from kvdepot.server.depot import Depot
from tests.unit.support.depot import OWNER


def test_every_request_type_has_a_row_and_a_handler(depot: Depot) -> None:
    assert set(REQUESTS) == set(RequestType)
    assert set(depot._handlers) == set(RequestType)
    # A new way of serving (a third Served kind) needs threads of its own.
    assert set(depot._threads) == set(Served) - {Served.INLINE}


def test_served_decides_inline_or_transfer_thread(depot: Depot) -> None:
    for request_type, kind in REQUESTS.items():
        assert depot.is_slow(request_type) == (kind.served is Served.TRANSFER)
    assert depot.handle(RequestType.GET_CHUNK_SIZE, Empty(), OWNER) == DEFAULTS.chunk_size
    with pytest.raises(UnknownRequestType):
        depot.handle(RequestType.STORE, Empty(), OWNER)
