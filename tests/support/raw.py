"""A raw DEALER socket for tests that send what no client would, and the server's memory."""

from __future__ import annotations

import msgspec
import zmq

from kvdepot.protocol import ENCODER, REPLY_HEADER, REQUEST_HEADER, ErrorReply, RequestType
from kvdepot.rpc.credentials import find_credential


class RawSocket:
    def __init__(self, url: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        credential = find_credential(url)  # the owner's, as any client of this user finds it
        if credential is not None:
            credential.apply(self.sock, url)
        self.sock.connect(url)

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def send(self, call_id: int, request_type: RequestType | int, payload: object = b"") -> None:
        body = payload if isinstance(payload, bytes) else ENCODER.encode(payload)
        self.sock.send_multipart([REQUEST_HEADER.pack(call_id, int(request_type)), body])

    def reply(self, timeout: float) -> tuple[int, int, bytes] | None:
        """(call id, status, payload) of the next reply, None if none came in time."""
        if not self.sock.poll(int(timeout * 1000)):
            return None
        header, payload = self.sock.recv_multipart()
        call_id, status = REPLY_HEADER.unpack(header)
        return call_id, status, payload

    def call(self, request_type: RequestType, payload: object = b"", timeout: float = 30.0
             ) -> tuple[int, object]:
        """(status, decoded value or error message) of one request."""
        self.send(1, request_type, payload)
        got = self.reply(timeout)
        assert got is not None, f"no reply to {request_type.name} within {timeout} s"
        _, status, body = got
        if status:
            return status, msgspec.msgpack.decode(body, type=ErrorReply).message
        return status, msgspec.msgpack.decode(body)

    def close(self) -> None:
        self.sock.close(linger=0)


def memory_kib(pid: int, field: str = "VmRSS") -> int:
    """A memory figure of process `pid` from /proc (VmRSS: now; VmHWM: the peak)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def open_fds(pid: int) -> int:
    import os

    return len(os.listdir(f"/proc/{pid}/fd"))


def descriptors_of(pid: int, inodes: set[int]) -> dict[int, int]:
    """How many of the process's descriptors point at each of these files (inode numbers
    of memfds this test made): what the server holds of *this test's* memory, whatever
    other clients have registered."""
    import os

    held = dict.fromkeys(inodes, 0)
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            inode = os.stat(f"/proc/{pid}/fd/{fd}").st_ino
        except OSError:
            continue  # closed meanwhile
        if inode in held:
            held[inode] += 1
    return held
