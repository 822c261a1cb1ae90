"""Every error kvdepot raises, in one place.

Server-side failures travel to the client as an error reply carrying an `ErrorKind`;
the client turns it back into the matching exception class, so a caller can catch
`InvalidRequest` whether it was detected locally or by the server.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.IntEnum):
    INTERNAL = 1
    INVALID_REQUEST = 2
    UNKNOWN_REQUEST_TYPE = 3
    MALFORMED_PAYLOAD = 4
    NOT_REGISTERED = 5
    CHUNK_MISSING = 6
    LAYOUT_MISMATCH = 7
    OPERATION_CANCELLED = 8
    PERMISSION_DENIED = 9


class KVDepotError(Exception):
    """Base class of every kvdepot error."""

    kind: ErrorKind = ErrorKind.INTERNAL


class ServerError(KVDepotError):
    """The server failed while handling a well-formed request."""


class InvalidRequest(KVDepotError):
    """The request names something impossible: bad block ids, ranges, salts, sizes."""

    kind = ErrorKind.INVALID_REQUEST


class UnknownRequestType(KVDepotError):
    kind = ErrorKind.UNKNOWN_REQUEST_TYPE


class MalformedPayload(InvalidRequest):
    """The payload does not decode as its request type, or a field is past its bound."""

    kind = ErrorKind.MALFORMED_PAYLOAD


class NotRegistered(KVDepotError):
    """The worker's KV cache is not registered (e.g. the server restarted since)."""

    kind = ErrorKind.NOT_REGISTERED


class ChunkMissing(KVDepotError):
    """A retrieve named a chunk the server does not hold (evicted or never stored)."""

    kind = ErrorKind.CHUNK_MISSING

    def __init__(self, message: str, index: int = -1) -> None:
        super().__init__(message)
        self.index = index
        """Which of the chunks asked for is missing (-1 when not known, as on a client)."""


class LayoutMismatch(KVDepotError):
    """A chunk was stored by an engine whose KV layout differs from the reader's."""

    kind = ErrorKind.LAYOUT_MISMATCH


class OperationCancelled(KVDepotError):
    """The worker gave up on a store or retrieve (its fence said so) before the server ran it."""

    kind = ErrorKind.OPERATION_CANCELLED


class PermissionDenied(KVDepotError):
    """The caller's credential does not allow this request (CLEAR and STATS need `admin`)."""

    kind = ErrorKind.PERMISSION_DENIED


class ServerUnavailable(KVDepotError, ConnectionError):
    """The server cannot be reached, or the connection dropped with the request in flight."""


class AuthenticationFailed(ServerUnavailable):
    """The server refused this client's credential, or the client has none it accepts."""


class AddressInUse(KVDepotError):
    """`kvdepot serve` cannot listen where it was told to (raised at start, never sent)."""


_BY_KIND: dict[ErrorKind, type[KVDepotError]] = {
    cls.kind: cls
    for cls in (ServerError, InvalidRequest, UnknownRequestType, MalformedPayload,
                NotRegistered, ChunkMissing, LayoutMismatch, OperationCancelled,
                PermissionDenied)
}


def error_from_kind(kind: int, message: str) -> KVDepotError:
    """Rebuild the exception the server reported."""
    try:
        cls = _BY_KIND[ErrorKind(kind)]
    except ValueError:
        cls = ServerError
    return cls(message)
