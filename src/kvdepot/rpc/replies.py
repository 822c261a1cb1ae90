"""Turning a reply's two frames back into a value or the server's exception.

Shared by the I/O thread (asynchronous requests) and the call socket (blocking calls),
so both raise exactly the same errors for the same reply.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvdepot.errors import error_from_kind
from kvdepot.protocol import (
    ERROR_DECODER,
    REPLY_HEADER,
    RESPONSE_DECODERS,
    STATUS_OK,
    RequestType,
)


def reply_call_id(header: bytes) -> int:
    return REPLY_HEADER.unpack(header)[0]


def decode_reply(request_type: RequestType, header: bytes, payload: bytes
                 ) -> tuple[Any, BaseException | None]:
    """(value, None) for a success, (None, exception) for an error reply or a reply that
    does not decode as `request_type`'s response."""
    _, status = REPLY_HEADER.unpack(header)
    if status != STATUS_OK:
        return None, error_from_kind(status, ERROR_DECODER.decode(payload).message)
    try:
        return RESPONSE_DECODERS[request_type].decode(payload), None
    except msgspec.DecodeError as exc:
        return None, exc
