"""Per-operation fences: a worker gives up on a store or retrieve only once the server can
no longer touch that operation's engine blocks.

A worker owns a small shared-memory file, one 8-byte word per slot, and hands it to the
server with its KV memory. Each store or retrieve takes a free slot and a fresh generation
and the worker writes (generation, PENDING) into the slot before sending. The slot's
bytes double as a POSIX record lock (fcntl), which the kernel keeps per process, so the
worker's and the server's locks conflict even when both hold the same open file, and a
process that dies drops its locks.

Server (`ServerFence.hold`): lock the slot, check the word is still (generation, PENDING),
run every copy of the operation (until the copies have completed, on a GPU too), write
DONE (or FAILED when a copy raised), unlock. Anything else in the word means the worker
cancelled the operation: no byte moves.

Worker (`ClientFence.try_cancel`), when it gives up (server unhealthy, connection lost):
try the lock without waiting. Got it: PENDING becomes CANCELLED (the server will never
run it), DONE or FAILED tell how the server finished it. Busy: the server is in the middle
of the copies, so the operation stays pending and is tried again later.

The word is `generation << 8 | state`; generations never repeat within a worker, so an
operation the server picks up late never mistakes a reused slot for its own.

A process loses all its POSIX locks on a file when it closes any descriptor of that file,
so the server never closes a descriptor of a fence file while anything still uses it,
however many registrations name the file (`_FenceFile`). Whoever changes how descriptors
reach the server must keep that rule.
"""

from __future__ import annotations

import collections
import enum
import errno
import fcntl
import itertools
import mmap
import os
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import numpy as np

from kvdepot.errors import InvalidRequest, NotRegistered, OperationCancelled
from kvdepot.transfer.sealed_memory import create_sealable, seal_size

SLOTS = 4096
"""Operations one worker may have in flight at once."""
WORD_BYTES = 8
MAX_FENCE_BYTES = 1 << 20
"""The largest fence a server accepts (bounds what one registration maps)."""
LOCK_PATIENCE = 1.0
"""Seconds the server waits for a slot the worker holds (a worker holds one only for a
few instructions; one stopped while holding it gets its operation refused, not run)."""

_STATE_BITS = 8
_STATE_MASK = (1 << _STATE_BITS) - 1


class SlotState(enum.IntEnum):
    FREE = 0
    PENDING = 1
    DONE = 2
    FAILED = 3
    CANCELLED = 4


class Resolution(enum.Enum):
    """What `ClientFence.try_cancel` found."""

    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    BUSY = "busy"


def fence_word(generation: int, state: SlotState) -> int:
    return generation << _STATE_BITS | int(state)


def _try_lock(fd: int, slot: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, WORD_BYTES, slot * WORD_BYTES,
                    os.SEEK_SET)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise
    return True


def _unlock(fd: int, slot: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_UN, WORD_BYTES, slot * WORD_BYTES, os.SEEK_SET)


class ClientFence:
    """The worker's side: creates the fence file, hands out slots, cancels."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        self.nbytes = slots * WORD_BYTES
        self.fd = create_sealable("kvdepot-fence", self.nbytes)
        seal_size(self.fd)  # the server maps it: it must never shrink
        self._map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)
        self._words = np.frombuffer(self._map, dtype="<u8")
        self._free = collections.deque(range(slots))
        self._generations = itertools.count(1)
        self._mutex = threading.Lock()

    def begin(self) -> tuple[int, int] | None:
        """A free slot and a fresh generation, marked PENDING; None when every slot is taken."""
        with self._mutex:
            if not self._free:
                return None
            slot = self._free.popleft()
            generation = next(self._generations)
        # A free slot is one the server can no longer act on under any generation it was
        # given, and an aligned 8-byte store is atomic: no lock is needed to arm it.
        self._words[slot] = fence_word(generation, SlotState.PENDING)
        return slot, generation

    def release(self, slot: int) -> None:
        """The operation in `slot` is resolved (its reply came, or `try_cancel` decided it)."""
        with self._mutex:
            self._free.append(slot)

    def try_cancel(self, slot: int, generation: int) -> Resolution:
        """Settle an operation the worker no longer waits for; never blocks."""
        if not _try_lock(self.fd, slot):
            return Resolution.BUSY
        try:
            word = int(self._words[slot])
            if word == fence_word(generation, SlotState.DONE):
                return Resolution.DONE
            if word == fence_word(generation, SlotState.FAILED):
                return Resolution.FAILED
            self._words[slot] = fence_word(generation, SlotState.CANCELLED)
            return Resolution.CANCELLED
        finally:
            _unlock(self.fd, slot)

    def state(self, slot: int) -> tuple[int, SlotState]:
        """(generation, state) of a slot, for tests and diagnostics."""
        word = int(self._words[slot])
        return word >> _STATE_BITS, SlotState(word & _STATE_MASK)

    def close(self) -> None:
        if self.fd < 0:
            return
        self._words = np.zeros(0, dtype="<u8")
        with suppress(BufferError):  # a view is still alive; the mapping goes with it
            self._map.close()
        os.close(self.fd)
        self.fd = -1


class _FenceFile:
    """One fence file as the server has it open: one mapping, shared by every registration
    that names the file (a worker re-registering, say). POSIX record locks are dropped when
    the process closes *any* descriptor of the file, so no descriptor of it is closed
    before nothing uses it any more: one that a later registration brings is kept too."""

    def __init__(self, key: tuple[int, int], fd: int, nbytes: int) -> None:
        self.key = key
        self.fd = fd
        self.nbytes = nbytes
        self.map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        self.words = np.frombuffer(self.map, dtype="<u8")
        self.users = 0
        """Registrations using it plus operations holding one of its slots."""
        self.holding = 0
        """Operations locking (or about to lock) one of its slots: while any does, no
        descriptor of the file may close."""
        self.more_fds: list[int] = []
        """Descriptors of this file handed over while slots were locked, closed as soon
        as none is (so repeated registrations cannot pile descriptors up)."""

    def close_or_park(self, fd: int) -> None:
        """Under _OPEN_FILES_MUTEX: close another descriptor of this file now, or, while a
        slot is locked (closing it would drop that lock), once none is."""
        if self.holding:
            self.more_fds.append(fd)
        else:
            os.close(fd)

    def close_parked(self) -> None:
        """Under _OPEN_FILES_MUTEX, with no slot locked."""
        for fd in self.more_fds:
            os.close(fd)
        self.more_fds.clear()

    def release(self) -> None:
        self.words = np.zeros(0, dtype="<u8")
        with suppress(BufferError):
            self.map.close()
        for fd in (self.fd, *self.more_fds):
            os.close(fd)


_OPEN_FILES: dict[tuple[int, int], _FenceFile] = {}
_OPEN_FILES_MUTEX = threading.Lock()


def _acquire_file(fd: int, nbytes: int) -> _FenceFile:
    """The shared `_FenceFile` of the file behind `fd` (whose ownership passes here)."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidRequest("the fence is not a shared-memory file")
        if not 0 < nbytes <= MAX_FENCE_BYTES or nbytes % WORD_BYTES:
            raise InvalidRequest(f"a fence of {nbytes} bytes: it must be a positive "
                                 f"multiple of {WORD_BYTES} up to {MAX_FENCE_BYTES}")
        if info.st_size < nbytes:
            raise InvalidRequest(f"the fence file has {info.st_size} bytes, not the "
                                 f"{nbytes} the registration claims")
        key = (info.st_dev, info.st_ino)
        with _OPEN_FILES_MUTEX:
            shared = _OPEN_FILES.get(key)
            if shared is not None:
                shared.close_or_park(fd)
                fd = -1
                if shared.nbytes != nbytes:
                    raise InvalidRequest("this fence is already registered with another size")
            else:
                shared = _OPEN_FILES[key] = _FenceFile(key, fd, nbytes)
            shared.users += 1
            return shared
    except BaseException:
        if fd >= 0:
            close_descriptor(fd)
        raise


def close_descriptor(fd: int) -> None:
    """Close a descriptor a client handed over; one of an open fence's file waits until no
    slot of it is locked (closing it would drop the locks of operations running now).
    Every descriptor the server was given is closed through here."""
    try:
        info = os.fstat(fd)
    except OSError:
        return
    with _OPEN_FILES_MUTEX:
        shared = _OPEN_FILES.get((info.st_dev, info.st_ino))
        if shared is not None:
            shared.close_or_park(fd)
            return
    os.close(fd)


def _drop_file(shared: _FenceFile) -> None:
    with _OPEN_FILES_MUTEX:
        shared.users -= 1
        if shared.users:
            return
        del _OPEN_FILES[shared.key]
        shared.release()


class ServerFence:
    """The server's side of one registration's fence; takes ownership of the descriptor.

    The file stays open while a registration uses it or an operation holds one of its slots.
    """

    def __init__(self, fd: int, nbytes: int) -> None:
        self._file = _acquire_file(fd, nbytes)
        self.slots = nbytes // WORD_BYTES
        self._mutex = threading.Lock()
        self._closed = False

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise InvalidRequest(f"fence slot {slot} is outside the registration's "
                                 f"{self.slots} slots")

    @contextmanager
    def hold(self, slot: int, generation: int) -> Iterator[None]:
        """Run the body (the operation's copies) only while the slot says (generation,
        PENDING), with the slot locked; DONE (or FAILED if the body raised) is written
        before the lock is released."""
        self.check_slot(slot)
        shared = self._file
        with self._mutex:
            if self._closed:
                raise NotRegistered("the engine unregistered while its operation was queued")
            with _OPEN_FILES_MUTEX:
                shared.users += 1
                shared.holding += 1
        try:
            _lock_patiently(shared.fd, slot)
            # No local name for `shared.words`: an error raised here keeps this frame (and
            # its locals) alive in its traceback, and a live view of the mapping would keep
            # the mapping, and the descriptor it holds, open past `release`.
            try:
                if int(shared.words[slot]) != fence_word(generation, SlotState.PENDING):
                    raise OperationCancelled(
                        "the worker gave up on this operation before it ran; nothing was "
                        "copied")
                try:
                    yield
                except BaseException:
                    shared.words[slot] = fence_word(generation, SlotState.FAILED)
                    raise
                shared.words[slot] = fence_word(generation, SlotState.DONE)
            finally:
                _unlock(shared.fd, slot)
        finally:
            with _OPEN_FILES_MUTEX:
                shared.holding -= 1
                if not shared.holding:
                    shared.close_parked()
            _drop_file(shared)

    def close(self) -> None:
        """This registration is gone; the file closes once nothing else uses it."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
        _drop_file(self._file)


def _lock_patiently(fd: int, slot: int) -> None:
    deadline = time.monotonic() + LOCK_PATIENCE
    pause = 0.0002
    while not _try_lock(fd, slot):
        if time.monotonic() > deadline:
            raise OperationCancelled("the worker kept its fence slot locked; the operation "
                                     "was not run")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
