"""The server's side of the GPUs' copy processes: one started with the server for every
GPU it sees, sent each operation's copies, and started again after it died.

A copy process that dies fails the copies it had in flight (the engines recompute those
blocks) and nothing else: the next copy on that GPU starts a new one, into which every
registration there is opened again from the handles the server kept, so engines do not
register again. A process that keeps dying is restarted less and less often (up to
`MAX_BACKOFF`), and copies meanwhile fail at once with the reason.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import msgspec
import numpy as np

from kvdepot.errors import KVDepotError, NotRegistered, ServerError, error_from_kind
from kvdepot.protocol import RegisterKVCache
from kvdepot.transfer.copy_process import wire
from kvdepot.transfer.group_copy import GroupCopy

log = logging.getLogger(__name__)

START_TIMEOUT = 240.0
"""Seconds a copy process may take to start: importing torch, creating its CUDA context
and page-locking the whole pool, which takes seconds per tens of GiB."""
STOP_TIMEOUT = 10.0
"""Seconds a stopping copy process gets to finish its copies and let go of engine memory."""
EXIT_GRACE = 2.0
"""Seconds a copy process whose channels closed gets to finish exiting before it is
killed."""
FIRST_BACKOFF = 1.0
MAX_BACKOFF = 30.0
STABLE_SECONDS = 60.0
"""A process that ran this long before it died starts again after `FIRST_BACKOFF`."""


class CopyProcess:
    """One GPU's copy process: its channels, and whether it failed."""

    def __init__(self, device: int, pool_fd: int, pool_bytes: int, pin: bool,
                 channels: int) -> None:
        self.device = device
        self.failed = False
        self.started_at = 0.0
        self.failed_at = 0.0
        self._pool = (pool_fd, pool_bytes)
        self._pin = pin
        self._count = channels
        self._free: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()
        self._channels: list[socket.socket] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._fail_lock = threading.Lock()

    def start(self) -> None:
        self.started_at = time.monotonic()
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                 for _ in range(self._count)]
        theirs = [b for _, b in pairs]
        self._channels = [a for a, _ in pairs]
        pool_fd, pool_bytes = self._pool
        args = [sys.executable, "-m", "kvdepot.transfer.copy_process.main",
                "--device", str(self.device),
                "--pool-fd", str(pool_fd), "--pool-bytes", str(pool_bytes),
                "--channels", ",".join(str(s.fileno()) for s in theirs),
                "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]
        if not self._pin:
            args.append("--no-pin")
        try:
            # A session of its own: a Ctrl-C at the server's terminal is the server's to
            # act on (it drains, and its copies need this process until then).
            self._proc = subprocess.Popen(args, pass_fds=[pool_fd, *(s.fileno() for s in theirs)],
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            for s in theirs:
                s.close()
        first = self._channels[0]
        first.settimeout(START_TIMEOUT)
        try:
            ready = wire.READY.decode(wire.receive(first, wire.MAX_REPLY_BYTES))
        except (OSError, msgspec.DecodeError) as exc:
            self.fail()
            raise ServerError(f"the copy process for cuda:{self.device} did not start: it "
                              f"{self.exit_description()} ({exc})") from None
        first.settimeout(None)
        for channel in self._channels:
            self._free.put(channel)
        log.info("copy process for cuda:%d (%s): pid %d", self.device, ready.device_name,
                 ready.pid)

    def call(self, request: wire.Request, fds: list[int] | None = None) -> None:
        """Send `request` (with `fds` attached) and wait for its outcome; raises what the
        copy process reported, or ServerError once it died."""
        if self.failed:
            raise ServerError(f"the copy process for cuda:{self.device} "
                              f"{self.exit_description()}")
        channel = self._free.get()
        try:
            wire.send(channel, request, fds)
            body = wire.receive(channel, wire.MAX_REPLY_BYTES)
            outcome = wire.OUTCOMES.decode(body)
        except (OSError, msgspec.DecodeError):
            self.fail()
            raise ServerError(f"the copy process for cuda:{self.device} "
                              f"{self.exit_description()} during this copy; the blocks it "
                              "did not move count as not loaded") from None
        finally:
            self._free.put(channel)
        if outcome.error_kind:
            raise error_from_kind(outcome.error_kind, outcome.message)

    def fail(self) -> None:
        """Make sure the process is gone (its channels said it is, or a reply made no
        sense): every call waiting on it ends, and none is sent again."""
        with self._fail_lock:
            if self.failed:
                return
            self.failed = True
            self.failed_at = time.monotonic()
        # A closed channel mostly means it is exiting: let it, so its own status is what
        # gets reported.
        self._end(EXIT_GRACE)
        # The back-off counts from here: on a loaded host the wait above can outlast it,
        # and a new process would then start while the caller still hears of the old one.
        self.failed_at = time.monotonic()
        log.warning("the copy process for cuda:%d %s", self.device, self.exit_description())

    def _end(self, timeout: float) -> bool:
        """Shut every channel (which wakes calls blocked on their reply and tells the
        process to exit), give the process `timeout` seconds to exit, then kill it; and
        reap it. Returns whether it had to be killed."""
        for channel in self._channels:
            with contextlib.suppress(OSError):
                channel.shutdown(socket.SHUT_RDWR)
        if self._proc is None:
            return False
        try:
            self._proc.wait(timeout)
            return False
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            return True

    def exit_description(self) -> str:
        code = self._proc.poll() if self._proc is not None else None
        if code is None:
            return "stopped answering"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def stop(self) -> None:
        """Close the channels: the process finishes its copies, lets go of engine memory
        and exits; killed if it takes longer than `STOP_TIMEOUT`."""
        if self._end(STOP_TIMEOUT):
            log.warning("the copy process for cuda:%d did not stop in %.0f s; killed it",
                        self.device, STOP_TIMEOUT)
        self.failed = True
        for channel in self._channels:
            channel.close()


class CopyProcesses:
    """The copy processes of one server, one per GPU it sees (`start`)."""

    def __init__(self, pool_fd: int, pool_bytes: int, pin: bool, channels: int) -> None:
        """`pool_fd`: the shared pool's memfd (`host_pool.allocate_shared_pool`), which
        every process maps; `channels`: requests one process takes at once (more than the
        server's transfer threads, so no caller ever waits for a free one)."""
        self._args = (pool_fd, pool_bytes, pin, channels)
        self._processes: dict[int, CopyProcess] = {}
        self._backoff: dict[int, float] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        self._labels = itertools.count(1)
        self._closed = False

    def running(self, device: int) -> CopyProcess:
        """GPU `device`'s copy process, started (again) if it is not running."""
        with self._lock:
            lock = self._locks.setdefault(device, threading.Lock())
        with lock:
            if self._closed:
                raise ServerError("the server is stopping")
            current = self._processes.get(device)
            if current is not None and not current.failed:
                return current
            if current is not None:
                lived = current.failed_at - current.started_at
                backoff = (FIRST_BACKOFF if lived >= STABLE_SECONDS
                           else min(2 * self._backoff.get(device, FIRST_BACKOFF / 2),
                                    MAX_BACKOFF))
                self._backoff[device] = backoff
                wait = current.failed_at + backoff - time.monotonic()
                if wait > 0:
                    raise ServerError(f"the copy process for cuda:{device} "
                                      f"{current.exit_description()}; it starts again in "
                                      f"{wait:.1f} s")
            process = CopyProcess(device, *self._args)
            self._processes[device] = process
            process.start()  # a failed start stays as the failed process, for the backoff
            return process

    def map(self, request: RegisterKVCache, pid: int, uid: int,
            vmm_fds: dict[int, int] | None = None) -> RemoteCudaCopier:
        """A CUDA registration (handed over by process `pid` of user `uid`) as a copier,
        opened in its GPU's copy process (`EngineRegistry`'s `CudaCopies`); `vmm_fds`:
        the handed-over descriptors of its driver-mapped allocations, by handover index
        (duplicated here: the caller still closes its own)."""
        from kvdepot.transfer.cuda_ipc_mapping import checked_device  # torch.cuda, lazily

        device = checked_device(request.allocations, pid, uid)  # type: ignore[arg-type]
        copier = RemoteCudaCopier(self, device, next(self._labels), request, vmm_fds)
        try:
            copier.open()
        except BaseException:
            copier.close()
            raise
        return copier

    def start(self, devices: Sequence[int]) -> None:
        """Start the copy processes of `devices` at once, and wait for them: the server is
        ready once its pool is page-locked for every GPU, and no engine's first
        registration waits for a process to start. One that fails to start is logged;
        the first copy on its GPU tries again."""
        def start_one(device: int) -> None:
            try:
                self.running(device)
            except KVDepotError as exc:
                log.error("%s", exc)

        threads = [threading.Thread(target=start_one, args=(d,), daemon=True) for d in devices]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for process in list(self._processes.values()):
            if not process.failed:
                process.stop()


class RemoteCudaCopier:
    """The `Copier` of one CUDA registration, whose copies its GPU's copy process runs."""

    def __init__(self, processes: CopyProcesses, device: int, label: int,
                 request: RegisterKVCache, vmm_fds: dict[int, int] | None = None) -> None:
        self.device = device
        self._processes = processes
        self._label = label
        # Kept open for the registration's life: a copy process started after one died
        # imports the driver-mapped allocations again from them.
        indices = sorted(vmm_fds or {})
        self._fds = [os.dup(vmm_fds[i]) for i in indices] if vmm_fds else []
        self._open_request = wire.Open(label, list(request.allocations),  # type: ignore[arg-type]
                                       list(request.layers), request.block_size, indices)
        self._opened_in: CopyProcess | None = None
        self._lock = threading.Lock()
        self._closed = False

    def open(self) -> CopyProcess:
        """The copy process this registration is open in (opened there first if it is a
        new one)."""
        process = self._processes.running(self.device)
        if self._opened_in is process:
            return process
        with self._lock:
            if self._closed:
                raise NotRegistered("the engine unregistered while its copy was queued")
            if self._opened_in is not process:
                if self._fds:
                    process.call(self._open_request, self._fds)
                else:
                    process.call(self._open_request)
                self._opened_in = process
        return process

    def gather(self, groups: Sequence[GroupCopy], event_handle: bytes | None = None) -> None:
        self._copy(groups, event_handle, to_host=True)

    def scatter(self, groups: Sequence[GroupCopy], event_handle: bytes | None = None) -> None:
        self._copy(groups, event_handle, to_host=False)

    def _copy(self, groups: Sequence[GroupCopy], event_handle: bytes | None, to_host: bool
              ) -> None:
        """One request for every group with blocks to copy (none: nothing is sent). The
        extents are offsets in the pool the tier carved them from, which is the shared
        pool every copy process maps."""
        parts = [_on_the_wire(g) for g in groups if len(g.plan.block_ids)]
        if not parts:
            return
        request = wire.Copy(self._label, to_host, groups[0].plan.blocks_per_chunk, parts,
                            event_handle or b"")
        self.open().call(request)

    def close(self) -> None:
        """Drops the mappings in the copy process, once its copies in flight are done."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            process, self._opened_in = self._opened_in, None
            fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
        if process is not None and not process.failed:
            try:
                process.call(wire.Close(self._label))
            except KVDepotError as exc:
                log.warning("closing engine memory in the copy process for cuda:%d: %s",
                            self.device, exc)


def _on_the_wire(group: GroupCopy) -> wire.GroupCopy:
    plan, extents = group.plan, group.extents
    return wire.GroupCopy(plan.group, plan.block_ids.astype(np.int64, copy=False).tobytes(),
                          plan.first_slot, extents.offsets.astype(np.int64, copy=False).tobytes(),
                          extents.length)
