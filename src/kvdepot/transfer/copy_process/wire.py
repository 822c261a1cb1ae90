"""What the server and a GPU's copy process say to each other, and how it is framed.

Each message is msgpack behind a 4-byte length, over a Unix socket pair the server
created and handed to the child when it started it: no path or name another process
could connect to, so nothing but the server can ask a copy process to move memory.
A channel carries one request at a time, then its reply.
"""

from __future__ import annotations

import os
import socket
import struct

import msgspec

from kvdepot.protocol import CudaIPCMemory, CudaVMMMemory, LayerSpec

_LENGTH = struct.Struct("<I")
MAX_REPLY_BYTES = 1 << 20
"""Replies are a status and a message; anything longer is a broken copy process."""
MAX_FDS = 253
"""Linux's SCM_MAX_FD: the most descriptors one message carries (a registration hands
over no more)."""


class Open(msgspec.Struct, tag="open"):
    """Map a registration's KV memory (the server checked it before sending)."""

    engine: int
    """The server's label of the registration."""
    allocations: list[CudaIPCMemory | CudaVMMMemory]
    layers: list[LayerSpec]
    block_size: int
    vmm_fd_indices: list[int] = []
    """The handover `fd_index` of each descriptor sent with this message (SCM_RIGHTS), in
    order: the driver-mapped allocations' exports, which the copy process imports."""


class GroupCopy(msgspec.Struct):
    """One KV cache group's part of a `Copy`."""

    group: int
    """Which of the registration's KV cache groups."""
    block_ids: bytes
    """int64, the plan's blocks (slots before `first_slot` already left out)."""
    first_slot: int
    chunk_offsets: bytes
    """int64: where each chunk's part for this group starts in the shared pool."""
    chunk_bytes: int
    """Bytes of each chunk's part for this group."""


class Copy(msgspec.Struct, tag="copy"):
    """Every KV cache group's copies of one store (`to_host`) or retrieve, answered by one
    `Outcome` once all of them are done."""

    engine: int
    to_host: bool
    blocks_per_chunk: int
    groups: list[GroupCopy]
    """Only groups with blocks to copy, each at most once."""
    event_handle: bytes


class Close(msgspec.Struct, tag="close"):
    """Drop a registration's mappings once its copies in flight are done."""

    engine: int


Request = Open | Copy | Close


class Outcome(msgspec.Struct):
    """The reply to every request: `error_kind` 0 when it succeeded, else an
    `ErrorKind` value and what went wrong."""

    error_kind: int = 0
    message: str = ""


class Ready(msgspec.Struct):
    """The copy process's first message: it mapped the pool and can take requests."""

    pid: int
    device_name: str


_encoder = msgspec.msgpack.Encoder()
REQUESTS = msgspec.msgpack.Decoder(Request)
OUTCOMES = msgspec.msgpack.Decoder(Outcome)
READY = msgspec.msgpack.Decoder(Ready)


class ChannelClosed(ConnectionError):
    """The other end closed its channel (or died) before a whole message arrived."""


def send(channel: socket.socket, message: msgspec.Struct, fds: list[int] | None = None
         ) -> None:
    """Send `message`, with `fds` attached to its length prefix (sent alone first, so
    the descriptors ride on bytes one sendmsg surely sends whole)."""
    body = _encoder.encode(message)
    if fds:
        header = _LENGTH.pack(len(body))
        sent = socket.send_fds(channel, [header], fds)
        channel.sendall(header[sent:] + body)
        return
    channel.sendall(_LENGTH.pack(len(body)) + body)


def receive_with_fds(channel: socket.socket) -> tuple[bytes, list[int]]:
    """One message's bytes and the descriptors attached to it (the caller closes them)."""
    fds: list[int] = []
    header = bytearray()
    while len(header) < _LENGTH.size:
        data, got, flags, _ = socket.recv_fds(channel, _LENGTH.size - len(header), MAX_FDS)
        fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise ChannelClosed("descriptors sent with a message were cut short")
        if not data:
            for fd in fds:
                os.close(fd)
            raise ChannelClosed("the channel was closed")
        header += data
    (length,) = _LENGTH.unpack(bytes(header))
    try:
        return _read_exactly(channel, length), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def receive(channel: socket.socket, limit: int | None = None) -> bytes:
    """One message's bytes; `limit` bounds its length."""
    (length,) = _LENGTH.unpack(_read_exactly(channel, _LENGTH.size))
    if limit is not None and length > limit:
        raise ChannelClosed(f"a {length}-byte message is longer than the {limit} allowed")
    return _read_exactly(channel, length)


def _read_exactly(channel: socket.socket, n: int) -> bytes:
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        count = channel.recv_into(view[got:])
        if count == 0:
            raise ChannelClosed("the channel was closed")
        got += count
    return bytes(buffer)
