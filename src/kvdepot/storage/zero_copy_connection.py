"""A redis-py connection that sends big arguments straight from the caller's memory.

redis-py's command packer (hiredis's, when it is installed) turns every argument into
`bytes` and joins a command into one `bytes`: a SET of a 16 MiB piece is copied twice
before it reaches the socket, and those copies were most of the shared tier's
write-behind time. This connection packs a command holding an argument of
`ZERO_COPY_BYTES` or more itself (RESP headers around the caller's buffers, which
`sendall` reads in place); every other command is packed by redis-py as before, and
replies are parsed by redis-py's own parser (hiredis's when installed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.connection import Connection

ZERO_COPY_BYTES = 64 << 10
"""Arguments this big are sent from their own buffer; smaller ones are cheaper to copy
into the command than to send on their own."""


def _is_big(arg: Any) -> bool:
    return isinstance(arg, (bytes, bytearray, memoryview)) and (
        arg.nbytes if isinstance(arg, memoryview) else len(arg)) >= ZERO_COPY_BYTES


class _ZeroCopyPacker:
    def __init__(self, packer: Any, encode: Callable[[Any], Any]) -> None:
        self._packer = packer
        self._encode = encode

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        if not any(_is_big(arg) for arg in args):
            return self._packer.pack(*args)
        if isinstance(args[0], str) and " " in args[0]:  # "CONFIG SET" is two arguments
            args = (*args[0].split(), *args[1:])
        output: list[bytes | memoryview] = []
        header = [b"*%d\r\n" % len(args)]
        for arg in args:
            if _is_big(arg):
                view = memoryview(arg).cast("B")
                header.append(b"$%d\r\n" % view.nbytes)
                output += (b"".join(header), view)
                header = [b"\r\n"]
            else:
                data = self._encode(arg)
                header += (b"$%d\r\n" % len(data), data, b"\r\n")
        output.append(b"".join(header))
        return output


class ZeroCopyConnection(Connection):
    """A plain TCP connection (TLS keeps redis-py's `SSLConnection`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._command_packer = _ZeroCopyPacker(self._command_packer, self.encoder.encode)
