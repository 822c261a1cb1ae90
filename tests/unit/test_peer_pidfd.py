"""The handover's view of its peer: a pidfd from the socket, and what the server does when
it cannot have one (real Unix sockets and processes; the kernel's answers that cannot be
provoked here, a kernel without SO_PEERPIDFD and a process out of descriptors, are
stood in for at the one call that asks the kernel)."""

from __future__ import annotations

import errno
import os
import socket
import time

import pytest

from kvdepot.errors import InvalidRequest
from kvdepot.server import handover, peer_pidfd
from kvdepot.server.peer_pidfd import PidfdProcess
from kvdepot.server.worker_process import WorkerProcess


def _connected() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def test_the_peer_of_a_socket_is_held_by_a_pidfd():
    name = f"\0kvdepot-test-peer-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(name)
        listener.listen(1)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as mine:
            mine.connect(name)
            accepted, _ = listener.accept()
            with accepted:
                process = handover._watch(accepted, os.getpid())
    assert isinstance(process, PidfdProcess)
    try:
        assert process.pid == os.getpid() and process.alive()
    finally:
        process.close()


def test_a_pidfd_polls_readable_only_once_its_process_has_exited():
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    process = PidfdProcess.of(os.pidfd_open(pid))
    try:
        assert process.alive()
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        assert not process.alive()
    finally:
        process.close()


def test_a_peer_of_another_pid_namespace_without_a_pidfd_is_refused(monkeypatch):
    """A kernel without SO_PEERPIDFD: the pid reads 0 and nothing can watch the process."""
    monkeypatch.setattr(handover, "peer_pidfd", lambda conn: None)
    a, b = _connected()
    with a, b, pytest.raises(InvalidRequest, match="cannot watch this process"):
        handover._watch(a, 0)


def test_without_a_pidfd_a_peer_of_our_namespace_is_watched_through_proc(monkeypatch):
    monkeypatch.setattr(handover, "peer_pidfd", lambda conn: None)
    a, b = _connected()
    with a, b:
        process = handover._watch(a, os.getpid())
    assert isinstance(process, WorkerProcess) and process.alive()


def test_a_pidfd_that_cannot_be_had_now_refuses_for_now_and_registers_nothing(monkeypatch):
    def out_of_descriptors(conn: socket.socket) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(handover, "peer_pidfd", out_of_descriptors)
    a, b = _connected()
    with a, b, pytest.raises(InvalidRequest, match="try again later"):
        handover._watch(a, 0)


def test_a_pidfd_that_cannot_be_polled_counts_as_alive_never_as_dead(monkeypatch):
    """No proof of exit, no reaping: asked again at the next scan."""
    process = PidfdProcess.of(os.pidfd_open(os.getpid()))

    def failing(fd: int) -> bool:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(peer_pidfd, "_exited", failing)
    try:
        assert process.alive()
    finally:
        process.close()
    assert not process.alive()  # closed: nothing left to watch
