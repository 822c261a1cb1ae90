"""The fence protocol between a worker and the server, with the two sides in two processes
where the lock matters (POSIX record locks only conflict between processes)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

from kvdepot.errors import InvalidRequest, OperationCancelled
from kvdepot.transfer.fence import (
    ClientFence,
    Resolution,
    ServerFence,
    SlotState,
    close_descriptor,
)

HOLDER = """
import os
import sys
from kvdepot.transfer.fence import ServerFence, _try_lock
pid, fd, nbytes, slot, generation, role = map(int, sys.argv[1:7])
fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
if role == 0:  # a server stuck inside the copies
    fence = ServerFence(fd, nbytes)
    with fence.hold(slot, generation):
        print("holding", flush=True)
        sys.stdin.readline()
else:  # a worker stuck while it holds the slot
    assert _try_lock(fd, slot)
    print("holding", flush=True)
    sys.stdin.readline()
"""


def reopen(pid: int, fd: int) -> int:
    """Another descriptor of a process's file, as the handover socket gives the server one
    (the test opens it through /proc; the server never opens a path)."""
    return os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


@pytest.fixture
def client():
    fence = ClientFence(slots=8)
    yield fence
    fence.close()


def server_side(client: ClientFence) -> ServerFence:
    return ServerFence(reopen(os.getpid(), client.fd), client.nbytes)


def holder(client: ClientFence, slot: int, generation: int, role: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(os.getpid()), str(client.fd), str(client.nbytes),
         str(slot), str(generation), str(role)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=(client.fd,))
    assert proc.stdout is not None and proc.stdout.readline() == "holding\n"
    return proc


def test_a_completed_operation_reads_done(client):
    server = server_side(client)
    slot, generation = client.begin()
    ran = []
    with server.hold(slot, generation):
        ran.append(True)
    assert ran and client.state(slot) == (generation, SlotState.DONE)
    assert client.try_cancel(slot, generation) is Resolution.DONE
    server.close()


def test_a_cancelled_operation_never_runs(client):
    server = server_side(client)
    slot, generation = client.begin()
    assert client.try_cancel(slot, generation) is Resolution.CANCELLED
    with pytest.raises(OperationCancelled), server.hold(slot, generation):
        raise AssertionError("the body ran")
    assert client.state(slot) == (generation, SlotState.CANCELLED)
    server.close()


def test_a_late_operation_does_not_take_a_reused_slot_for_its_own(client):
    server = server_side(client)
    slot, old = client.begin()
    client.try_cancel(slot, old)
    client.release(slot)
    for _ in range(client.slots):  # the freed slot comes round again
        reused = client.begin()
        assert reused is not None
        if reused[0] == slot:
            break
    assert reused[0] == slot and reused[1] != old
    with pytest.raises(OperationCancelled), server.hold(slot, old):
        raise AssertionError("the stale operation ran")
    assert client.state(slot) == (reused[1], SlotState.PENDING)
    server.close()


def test_a_failed_copy_reads_failed(client):
    server = server_side(client)
    slot, generation = client.begin()
    with pytest.raises(ZeroDivisionError), server.hold(slot, generation):
        1 / 0  # noqa: B018
    assert client.try_cancel(slot, generation) is Resolution.FAILED
    server.close()


def test_the_worker_cannot_give_up_while_the_server_copies_and_can_once_it_dies(client):
    slot, generation = client.begin()
    server = holder(client, slot, generation, role=0)
    try:
        assert client.try_cancel(slot, generation) is Resolution.BUSY
        assert client.state(slot) == (generation, SlotState.PENDING)
    finally:
        server.kill()
        server.wait()
    # The kernel dropped the dead server's lock; it never finished: cancelled.
    assert client.try_cancel(slot, generation) is Resolution.CANCELLED


def test_the_server_finishing_while_the_worker_waits_reads_done(client):
    slot, generation = client.begin()
    server = holder(client, slot, generation, role=0)
    assert client.try_cancel(slot, generation) is Resolution.BUSY
    server.communicate("go\n", timeout=30)
    assert client.try_cancel(slot, generation) is Resolution.DONE


def test_a_worker_that_keeps_its_slot_locked_gets_the_operation_refused(client):
    server = server_side(client)
    slot, generation = client.begin()
    worker = holder(client, slot, generation, role=1)
    try:
        with pytest.raises(OperationCancelled, match="kept its fence slot locked"), \
                server.hold(slot, generation):
            raise AssertionError("ran without the lock")
    finally:
        worker.kill()
        worker.wait()
    assert client.state(slot) == (generation, SlotState.PENDING)
    server.close()


def test_slots_run_out_and_come_back(client):
    taken = [client.begin() for _ in range(client.slots)]
    assert None not in taken and client.begin() is None
    client.release(taken[3][0])
    assert client.begin() is not None


def test_the_server_checks_slots_and_files(client, tmp_path):
    server = server_side(client)
    for slot in (-1, client.slots):
        with pytest.raises(InvalidRequest, match="outside"), server.hold(slot, 1):
            pass
    server.close()
    with pytest.raises(InvalidRequest, match="bytes"):
        ServerFence(reopen(os.getpid(), client.fd), client.nbytes * 2)
    with pytest.raises(InvalidRequest, match="multiple"):
        ServerFence(reopen(os.getpid(), client.fd), 12)
    fd = os.open(tmp_path, os.O_RDONLY)
    with pytest.raises(InvalidRequest, match="not a shared-memory file"):
        ServerFence(fd, 64)


WORKER = """
import sys
from kvdepot.transfer.fence import ClientFence
fence = ClientFence(slots=8)
slot, generation = fence.begin()
print(fence.fd, fence.nbytes, slot, generation, flush=True)
for line in sys.stdin:
    print(fence.try_cancel(slot, generation).value, flush=True)
"""


def test_a_second_registration_of_one_fence_never_unlocks_the_first_ones_slots():
    """Closing any descriptor of a file drops the process's locks on it: the server keeps
    one file per fence, however many registrations name it, until nothing uses it."""
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        fd, nbytes, slot, generation = map(int, worker.stdout.readline().split())
        first = ServerFence(reopen(worker.pid, fd), nbytes)
        second = ServerFence(reopen(worker.pid, fd), nbytes)

        def ask() -> str:
            worker.stdin.write("try\n")
            worker.stdin.flush()
            return worker.stdout.readline().strip()

        with second.hold(slot, generation):
            first.close()  # the older registration goes while the newer one copies
            assert ask() == "busy"
            third = ServerFence(reopen(worker.pid, fd), nbytes)  # and another comes
            third.close()
            assert ask() == "busy"
        assert ask() == "done"
        second.close()
    finally:
        worker.kill()
        worker.wait()


def test_a_refused_handover_of_a_fence_in_use_keeps_its_slots_locked():
    """A worker re-registering hands its fence over again; if that registration is refused,
    the descriptor it brought is closed through close_descriptor, which must not drop the
    locks of operations that the earlier registration is running."""
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        fd, nbytes, slot, generation = map(int, worker.stdout.readline().split())
        fence = ServerFence(reopen(worker.pid, fd), nbytes)
        with fence.hold(slot, generation):
            close_descriptor(reopen(worker.pid, fd))  # a refused re-registration
            with pytest.raises(InvalidRequest):
                ServerFence(reopen(worker.pid, fd), nbytes + 3)  # a bad one
            worker.stdin.write("try\n")
            worker.stdin.flush()
            assert worker.stdout.readline().strip() == "busy"
        fence.close()
    finally:
        worker.kill()
        worker.wait()


def _descriptors_of(fd: int) -> list[str]:
    """This process's descriptors open on the same file as `fd`."""
    target = os.fstat(fd)
    found = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed meanwhile
            info = os.stat(f"/proc/self/fd/{name}")
            if (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino):
                found.append(name)
    return found


@pytest.mark.parametrize("outcome", ["cancelled", "failed"])
def test_a_closed_fence_keeps_no_descriptor_while_its_errors_live_on(client, outcome):
    """The server keeps an operation's error (a reply, a log line, a traceback in a
    reference cycle) past the registration's end: the fence's file must close all the
    same, mapping included (a mapping holds a descriptor of its own)."""
    before = _descriptors_of(client.fd)  # the worker's own, its mapping's among them
    server = server_side(client)
    slot, generation = client.begin()
    if outcome == "cancelled":
        client.try_cancel(slot, generation)
    kept = []
    try:
        with server.hold(slot, generation):
            raise ZeroDivisionError
    except (OperationCancelled, ZeroDivisionError) as exc:
        kept.append(exc)
    assert len(_descriptors_of(client.fd)) > len(before)
    server.close()
    assert _descriptors_of(client.fd) == before
    assert kept
