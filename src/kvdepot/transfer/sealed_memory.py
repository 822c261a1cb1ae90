"""Shared-memory files whose size is sealed: what the server maps can never shrink.

The server maps the files engines hand over (KV memory, fences). If a client could
shrink such a file, the server's next copy from the vanished pages would fault (SIGBUS)
and kill the whole server, every other engine's cache with it. Linux seals close that:
a memfd created with MFD_ALLOW_SEALING and sealed with F_SEAL_SHRINK can never shrink
again, whoever holds it. Clients create and seal their files here; the server accepts
only files carrying these seals (`require_sealed`).
"""

from __future__ import annotations

import fcntl
import os

from kvdepot.errors import InvalidRequest

SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
"""The seals the server requires. Growing would be harmless to the server; it is sealed
too so that the size the registration claims stays the file's size."""


def create_sealable(name: str, nbytes: int) -> int:
    """A new memfd of `nbytes` zero bytes that can be sealed (close-on-exec)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def seal_size(fd: int) -> None:
    """Fix the file's size for good (and forbid any further seal, so no seal that would
    stop the server writing can be added later)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)


def require_sealed(fd: int, what: str) -> None:
    """Refuse a file whose size is not sealed: its owner could shrink it under the
    server's mapping."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a memfd: no seals at all
    if seals & SIZE_SEALS != SIZE_SEALS:
        raise InvalidRequest(f"{what} is not a memfd sealed against resizing (memfd_create with "
                             "MFD_ALLOW_SEALING, then F_SEAL_SHRINK and F_SEAL_GROW): the server "
                             "maps only memory its owner cannot shrink under it")
