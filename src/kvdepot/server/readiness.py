"""Whether the server can take a new engine now: what `/readyz` checks beyond the loop.

A server whose control loop answers may still be unable to take an engine: every
descriptor held (a new connection cannot be accepted, a handover cannot be received),
or the ZeroMQ I/O threads that accept and greet connections stalled. Both are checked
the way an engine would meet them:

- descriptor headroom: the process's open descriptors (/proc/self/fd) against its
  limit; fewer than `engine_reserve` free fails. Failing to list them (no descriptor
  left to open the directory with) fails too;
- the accept path: a TCP (or Unix) connection to the request socket must be greeted:
  libzmq sends the ZMTP signature, whose first byte is 0xFF, as soon as an I/O thread
  has taken the accepted connection. No greeting within `ACCEPT_PROBE_S` fails.

The answer is kept for `CACHE_S`, and one check runs at a time, so a flood of probes
opens at most one connection to the request socket per `CACHE_S`.
"""

from __future__ import annotations

import asyncio
import os
import time

ACCEPT_PROBE_S = 1.0
"""How long the request socket may take to greet a new connection: the goal for a new
engine is to connect and register within a second."""
CACHE_S = 1.0
RESERVE_SHARE = 16
MIN_RESERVE = 64


def engine_reserve(limit: int) -> int:
    """Free descriptors the engine path needs to take new engines (accepts, handshakes,
    handovers of memory files): 1/RESERVE_SHARE of the limit, at least MIN_RESERVE."""
    return max(MIN_RESERVE, limit // RESERVE_SHARE)


def open_descriptors() -> int | None:
    """This process's open descriptors, or None if they cannot be listed (listing takes
    one: with none free, that fails)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listing them
    except OSError:
        return None


def probe_address(url: str) -> tuple[str, int] | str:
    """Where a client of `url` connects: (host, port) for tcp://, a path for ipc://."""
    scheme, _, rest = url.partition("://")
    if scheme == "ipc":
        return rest
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    if host in ("*", "0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host, int(port)


class EngineReadiness:
    """The checks of the module for the request socket at `url`."""

    def __init__(self, url: str, descriptor_limit: int) -> None:
        self.address = probe_address(url)
        self.limit = descriptor_limit
        self.reserve = engine_reserve(descriptor_limit)
        self._lock = asyncio.Lock()
        self._checked_at = -CACHE_S
        self._reason: str | None = None

    async def reason_not_ready(self) -> str | None:
        """Why a new engine could not be taken now, or None if it could."""
        async with self._lock:
            if time.monotonic() - self._checked_at >= CACHE_S:
                self._reason = self._descriptors() or await self._accepts()
                self._checked_at = time.monotonic()
            return self._reason

    def _descriptors(self) -> str | None:
        held = open_descriptors()
        if held is None:
            return "no descriptor free: a new engine's connection cannot be accepted"
        if self.limit - held < self.reserve:
            return (f"{held} of {self.limit} descriptors open: fewer than the "
                    f"{self.reserve} kept for new engines are free")
        return None

    async def _accepts(self) -> str | None:
        writer = None
        try:
            async with asyncio.timeout(ACCEPT_PROBE_S):
                if isinstance(self.address, str):
                    reader, writer = await asyncio.open_unix_connection(self.address)
                else:
                    reader, writer = await asyncio.open_connection(*self.address)
                first = await reader.read(1)
        except TimeoutError:
            return (f"the request socket did not greet a new connection within "
                    f"{ACCEPT_PROBE_S:g} s (its accepting I/O threads are stalled)")
        except OSError as exc:
            return f"cannot connect to the request socket: {exc}"
        finally:
            if writer is not None:
                writer.transport.abort()
        if first != b"\xff":
            return "the request socket closed a new connection without greeting it"
        return None
