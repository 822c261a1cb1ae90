"""Driver-mapped allocations' descriptors between the server and a GPU's copy process:
they travel with the `Open` that names them (SCM_RIGHTS on the channel), the copy
process closes every descriptor it receives whatever becomes of the request, and the
server's copier keeps its own duplicates for the registration's life, no longer."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from kvdepot.errors import ErrorKind
from kvdepot.protocol import CudaVMMMemory, LayerSpec
from kvdepot.transfer.copy_process import main, wire
from kvdepot.transfer.copy_process.client import RemoteCudaCopier

GRANULE = 2 << 20


def memfd(tag: bytes) -> int:
    fd = os.memfd_create("vmm-test")
    os.write(fd, tag)
    return fd


def same_file(a: int, b: int) -> bool:
    x, y = os.fstat(a), os.fstat(b)
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def open_request(indices: list[int]) -> wire.Open:
    handles = [CudaVMMMemory(device_uuid="GPU-x", fd_index=i, allocation_bytes=GRANULE,
                             offset=0, nbytes=GRANULE) for i in indices]
    layer = LayerSpec("l0", 0, "uint8", [8, 16, 64], [1024, 64, 1], 0, 0)
    return wire.Open(engine=1, allocations=handles, layers=[layer], block_size=16,
                     vmm_fd_indices=indices)


@pytest.fixture
def channel() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield ours, theirs
    ours.close()
    theirs.close()


def test_descriptors_arrive_with_their_open(channel) -> None:
    ours, theirs = channel
    sent = [memfd(b"a"), memfd(b"b")]
    request = open_request([3, 7])
    wire.send(ours, request, sent)
    wire.send(ours, wire.Close(engine=1))  # the next message carries none
    body, got = wire.receive_with_fds(theirs)
    assert wire.REQUESTS.decode(body) == request
    assert len(got) == 2 and all(same_file(a, b) for a, b in zip(sent, got, strict=True))
    body, none = wire.receive_with_fds(theirs)
    assert wire.REQUESTS.decode(body) == wire.Close(engine=1) and none == []
    for fd in [*sent, *got]:
        os.close(fd)


def _serve(channel) -> tuple[main.CopyProcess, threading.Thread]:
    process = main.CopyProcess(0, torch.zeros(4096, dtype=torch.uint8), [channel])
    thread = threading.Thread(target=process.serve, daemon=True)
    thread.start()
    return process, thread


def test_the_copy_process_closes_every_descriptor_it_receives(channel) -> None:
    """An Open whose descriptors do not match the indices it names, and a Close that
    carries descriptors at all: both answered, and nothing received stays open."""
    ours, theirs = channel
    _, thread = _serve(theirs)
    wire.send(ours, wire.Close(engine=8))  # the loop is up: its own descriptors are open
    assert wire.OUTCOMES.decode(wire.receive(ours)).error_kind == 0
    before = set(os.listdir("/proc/self/fd"))
    sent = [memfd(b"a"), memfd(b"b")]
    wire.send(ours, open_request([1]), sent)
    outcome = wire.OUTCOMES.decode(wire.receive(ours))
    assert outcome.error_kind == ErrorKind.INTERNAL
    assert "named 1 descriptors and carried 2" in outcome.message
    wire.send(ours, wire.Close(engine=9), sent[:1])
    assert wire.OUTCOMES.decode(wire.receive(ours)).error_kind == 0
    for fd in sent:
        os.close(fd)
    # The loop closes them once its reply is out: give it a moment.
    deadline = time.monotonic() + 5
    while set(os.listdir("/proc/self/fd")) != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(os.listdir("/proc/self/fd")) == before
    ours.shutdown(socket.SHUT_RDWR)
    thread.join(10)
    assert not thread.is_alive()


class _Process:
    """The copy process as a `RemoteCudaCopier` sees it, recording each Open's
    descriptors as they were at the call."""

    def __init__(self) -> None:
        self.opens: list[list[int]] = []
        self.failed = False

    def running(self, device: int) -> _Process:
        return self

    def call(self, request: wire.Request, fds: list[int] | None = None) -> None:
        if isinstance(request, wire.Open):
            self.opens.append(list(fds or []))


def test_the_servers_copier_keeps_duplicates_until_it_closes() -> None:
    handed = {4: memfd(b"four"), 2: memfd(b"two")}
    process = _Process()
    registration = SimpleNamespace(allocations=[], layers=[], block_size=16)
    copier = RemoteCudaCopier(process, 0, 1, registration, handed)  # type: ignore[arg-type]
    for fd in handed.values():  # the registration's own copies close at once
        os.close(fd)
    copier.open()
    (sent,) = process.opens
    assert copier._open_request.vmm_fd_indices == [2, 4]
    assert [os.pread(fd, 8, 0) for fd in sent] == [b"two", b"four"]
    process.opens.clear()
    copier._opened_in = None  # as after the copy process died: opened again
    copier.open()
    assert process.opens == [sent]
    copier.close()
    assert not any(is_open(fd) for fd in sent)


def test_a_memfd_socket_pipe_or_file_is_no_cuda_export(tmp_path) -> None:
    from kvdepot.errors import InvalidRequest
    from kvdepot.transfer.cuda_vmm_mapping import check_vmm_descriptor

    a, b = socket.socketpair()
    r, w = os.pipe()
    path = tmp_path / "f"
    path.write_bytes(b"x")
    cases = {"a file": [memfd(b"m"), os.open(path, os.O_RDWR)], "a socket": [a.fileno()],
             "a pipe": [r], "a directory": [os.open(tmp_path, os.O_RDONLY)]}
    try:
        for kind, fds in cases.items():
            for fd in fds:
                with pytest.raises(InvalidRequest, match=f"is {kind}, not an export"):
                    check_vmm_descriptor(fd)
        null = os.open("/dev/null", os.O_RDWR)  # a device: the driver judges it
        assert stat.S_ISCHR(os.fstat(null).st_mode)
        check_vmm_descriptor(null)
        os.close(null)
    finally:
        for kind, fds in cases.items():
            for fd in fds:
                if kind != "a socket":
                    os.close(fd)
        a.close()
        b.close()
        os.close(w)
