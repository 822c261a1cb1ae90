"""The handover socket: workers hand the server their shared-memory files here.

The server never opens a file on a client's word. A worker connects to this Unix
socket (SOCK_SEQPACKET, in the abstract namespace under a random name that PING
replies carry, or, with a socket directory, at a path in it: abstract names exist per
network namespace, a directory crosses into containers), presents its credential's name
and token, and attaches its shared-memory file descriptors (SCM_RIGHTS): it can only
send files it has opened itself. The kernel tells the server the peer's pid and uid
(SO_PEERCRED; the pid reads 0 for a process of another PID namespace) and hands it a
pidfd of the peer's process (SO_PEERPIDFD), which proves its exit wherever it runs. The
server keeps the descriptors under a random one-time ticket for a short time; the
worker's REGISTER_KV_CACHE names the ticket, must come from the same credential, and
must claim the pid the handover reported (0 for a peer of another PID namespace).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import msgspec

from kvdepot.errors import InvalidRequest
from kvdepot.log_limiter import LogLimiter
from kvdepot.protocol import ENCODER, HandoverReply, HandoverRequest, SharedCPUMemory
from kvdepot.rpc.auth import CredentialStore
from kvdepot.rpc.connection_guard import descriptor_limit
from kvdepot.server.peer_pidfd import PeerExited, PidfdProcess, peer_pidfd
from kvdepot.server.socket_dir import HANDOVER_SOCKET, SocketDir
from kvdepot.server.worker_process import WorkerProcess
from kvdepot.transfer.fence import close_descriptor
from kvdepot.transfer.shm_mapping import SharedMapping, map_shared_fd

log = logging.getLogger(__name__)
refusals_log = LogLimiter(log)

MAX_FDS = 253
"""Linux's SCM_MAX_FD: the most descriptors one message can carry."""
MAX_REQUEST_BYTES = 4096
TICKET_TTL = 30.0
"""Seconds a ticket waits for its REGISTER_KV_CACHE."""
MAX_TICKETS_PER_UID = 64
"""Unclaimed tickets one uid may hold: a node of 8 engines x TP 8 run by one user hands
over 64 workers' memory at once when it starts (each ticket is claimed a moment later)."""
MAX_PARKED_FDS_PER_UID = 1024
"""Descriptors one uid may have parked in unclaimed tickets. A CUDA worker hands over
one (its fence), a CPU worker one per allocation plus its fence: 64 workers of one user
stay far below, while 64 tickets of 253 descriptors (16,192) would not."""
MAX_PARKED_FDS_PER_TENANT = 1024
"""The same bound for a named tenant over all its uids: a tenant gains nothing by
handing over from several accounts."""
PARKED_FDS_SHARE = 4
"""All parked descriptors together stay below 1/PARKED_FDS_SHARE of the server's
descriptor limit, whatever many uids and tenants do: the rest is for connections,
registrations and the server's own files."""
MAX_OPEN_CONNECTIONS = 64
MAX_OPEN_CONNECTIONS_PER_UID = 8
"""Any local user can connect here (the token is checked on the first message): one
user holding connections open must not take every slot from the others."""
CONNECTION_TIMEOUT = 2.0
"""A connection that sends nothing this long is closed."""
_PEERCRED = struct.Struct("3i")
_DECODER = msgspec.msgpack.Decoder(HandoverRequest)


def _peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected, as the kernel reports them."""
    return _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                            _PEERCRED.size))


def _watch(conn: socket.socket, pid: int) -> WorkerProcess | PidfdProcess:
    """The process that connected `conn`, held so that its exit can be proved: by a pidfd
    where the kernel gives one, else by its /proc entry (its own PID namespace only).
    Refuses a process that is gone already, or that cannot be watched: its registration
    could never be reaped, nor be told from a reused pid."""
    try:
        pidfd = peer_pidfd(conn)
        if pidfd is not None:
            return PidfdProcess.of(pidfd)
        if pid <= 0:
            # Another PID namespace: the pid reads 0, and 0 is no process of ours (kill(0)
            # would signal our own process group, /proc/0 is nobody).
            raise InvalidRequest(
                "the server cannot watch this process: it runs in another PID namespace and "
                "this kernel gives no pidfd of a socket's peer (SO_PEERPIDFD, Linux 6.5); "
                "run the server in the engine's PID namespace")
        process = WorkerProcess.of(pid)
    except PeerExited:
        process = None
    except OSError as exc:
        # Not proof that the worker is gone (e.g. no descriptor free here): a registration
        # whose process cannot be watched could never be reaped.
        raise InvalidRequest(f"the server cannot watch the process that connected now "
                             f"({exc}); try again later") from None
    if process is None:
        raise InvalidRequest("the process that connected to the handover socket has exited")
    return process


@dataclass
class HandedOverFiles:
    """The descriptors of one handover, claimed by one registration (which closes them)."""

    pid: int
    """The peer's pid in the server's PID namespace; 0 when it runs in another one."""
    uid: int
    fds: list[int]
    process: WorkerProcess | PidfdProcess | None = None
    """The process that handed them over: held by a pidfd where the kernel gives one,
    else as it was then (its pid may be reused after it exits; its start time tells)."""
    taken: set[int] = field(default_factory=set)

    def fd(self, handle: SharedCPUMemory) -> int:
        """The descriptor `handle` names (still owned here)."""
        return self._fd(handle)

    def _fd(self, handle: SharedCPUMemory) -> int:
        if not 0 <= handle.fd_index < len(self.fds):
            raise InvalidRequest(f"fd_index {handle.fd_index} is outside the {len(self.fds)} "
                                 "file descriptors handed over for this registration")
        return self.fds[handle.fd_index]

    def map(self, handle: SharedCPUMemory) -> SharedMapping:
        """Map the allocation `handle` names (checked: an unlinked shared-memory file,
        open read-write, at least `nbytes` long)."""
        return map_shared_fd(self._fd(handle), handle.nbytes)

    def take(self, handle: SharedCPUMemory) -> int:
        """Keep the descriptor open past the registration: the caller closes it."""
        fd = self._fd(handle)
        self.taken.add(fd)
        return fd

    def take_process(self) -> WorkerProcess | PidfdProcess | None:
        """The process, kept past the registration: the caller closes a pidfd's."""
        process, self.process = self.process, None
        return process

    def close(self) -> None:
        for fd in self.fds:
            if fd not in self.taken:
                close_descriptor(fd)
        self.fds = []
        if isinstance(self.process, PidfdProcess):
            self.process.close()
        self.process = None


@dataclass
class _Ticket:
    files: HandedOverFiles
    credential: str
    tenant: str
    expires: float


def _listening_socket(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(address)
        sock.listen(MAX_OPEN_CONNECTIONS)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class HandoverListener:
    def __init__(self, store: CredentialStore | None, limit: int | None = None,
                 socket_dir: SocketDir | None = None) -> None:
        """`store` None: the server runs --insecure and takes any name and token. `limit`:
        the server's descriptor limit (default: this process's soft RLIMIT_NOFILE, which
        the server has raised by now). `socket_dir`: also listen at a path in this
        directory (checked already), for engines of other network namespaces."""
        self._store = store
        self.descriptor_limit = limit or descriptor_limit()
        self.max_parked_fds = max(MAX_FDS, self.descriptor_limit // PARKED_FDS_SHARE)
        self.address = f"@kvdepot-handover-{secrets.token_hex(16)}"
        """Abstract socket address ('@' for the leading NUL): the random name cannot be
        squatted by another user; ownership is checked by the token, not by the name."""
        self._sock = _listening_socket("\0" + self.address[1:])
        self._listeners = [self._sock]
        self.socket_dir = socket_dir
        self.path_name = ""
        """The path socket's name inside the socket directory ("" without one): PING
        replies carry the name, each engine knows where it mounted the directory."""
        if socket_dir is not None:
            path = socket_dir.claim(HANDOVER_SOCKET)
            try:
                self._listeners.append(_listening_socket(str(path)))
                # Anyone who reaches the directory may connect: the token and the pidfd
                # decide what is served.
                socket_dir.make_connectable(HANDOVER_SOCKET)
            except BaseException:
                self._sock.close()
                raise
            self.path_name = HANDOVER_SOCKET
        self._tickets: dict[bytes, _Ticket] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # A byte here wakes the selector, so closing does not wait out its timeout.
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="kvdepot-handover", daemon=True)
        self._thread.start()

    # ---- registration side ------------------------------------------------------------
    def claim(self, ticket: bytes, credential: str, engine_pid: int) -> HandedOverFiles:
        """The files handed over under `ticket`, once; the registration must be made with
        the credential that handed them over and claim the pid the handover reported."""
        with self._lock:
            self._expire(time.monotonic())
            entry = self._tickets.pop(ticket, None)
        if entry is None or entry.credential != credential:
            if entry is not None:
                entry.files.close()
            raise InvalidRequest("unknown or expired handover ticket: hand the shared memory "
                                 "over again and register within "
                                 f"{TICKET_TTL:.0f} s, with the same credential")
        if engine_pid != entry.files.pid:
            # The only pid the server knows is the kernel's; across PID namespaces the kernel
            # reports 0 and no number a client names can be checked, so none is accepted.
            entry.files.close()
            raise InvalidRequest(
                f"the registration claims engine pid {engine_pid}, but the kernel reported pid "
                f"{entry.files.pid} for the handover (0: a process of another PID namespace); "
                "a worker claims the pid its handover reply carries")
        return entry.files

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):  # closed already
            self._wake_writer.send(b"\0")
        self._thread.join(timeout=5)
        self._wake_writer.close()
        with self._lock:
            for entry in self._tickets.values():
                entry.files.close()
            self._tickets.clear()

    # ---- the socket's thread -----------------------------------------------------------
    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        for listener in self._listeners:
            selector.register(listener, selectors.EVENT_READ)
        selector.register(self._wake_reader, selectors.EVENT_READ)
        deadlines: dict[socket.socket, float] = {}
        self._peer_uids: dict[socket.socket, int] = {}
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.5):
                    if key.fileobj in self._listeners:
                        assert isinstance(key.fileobj, socket.socket)
                        self._accept(key.fileobj, selector, deadlines)
                    elif key.fileobj is self._wake_reader:
                        continue  # close() set the stop flag
                    else:
                        conn = key.fileobj
                        assert isinstance(conn, socket.socket)
                        selector.unregister(conn)
                        deadlines.pop(conn, None)
                        self._peer_uids.pop(conn, None)
                        with conn:
                            self._serve(conn)
                now = time.monotonic()
                for conn, deadline in list(deadlines.items()):
                    if now > deadline:
                        selector.unregister(conn)
                        del deadlines[conn]
                        self._peer_uids.pop(conn, None)
                        conn.close()
                with self._lock:
                    self._expire(now)
                if self.socket_dir is not None:
                    self.socket_dir.check_still_there()
        finally:
            for conn in deadlines:
                conn.close()
            selector.close()
            self._wake_reader.close()
            for listener in self._listeners:
                listener.close()

    def _accept(self, listener: socket.socket, selector: selectors.BaseSelector,
                deadlines: dict[socket.socket, float]) -> None:
        try:
            conn, _ = listener.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                # The connection stays queued and the selector reports it again at once:
                # do not spin while descriptors are short.
                time.sleep(0.05)
            return
        uid = _peer_credentials(conn)[1]
        if (len(deadlines) >= MAX_OPEN_CONNECTIONS
                or sum(u == uid for u in self._peer_uids.values())
                >= MAX_OPEN_CONNECTIONS_PER_UID):
            refusals_log.warning("handover-connections", "refused a handover connection of "
                                 "uid %d: too many open", uid)
            conn.close()
            return
        self._peer_uids[conn] = uid
        conn.setblocking(False)
        selector.register(conn, selectors.EVENT_READ)
        deadlines[conn] = time.monotonic() + CONNECTION_TIMEOUT

    def _serve(self, conn: socket.socket) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, MAX_FDS)
        except OSError:
            return
        try:
            ticket, pid = self._admit(conn, data, fds, flags)
        except InvalidRequest as exc:
            for fd in fds:
                close_descriptor(fd)
            reply = HandoverReply(error=str(exc))
        else:
            reply = HandoverReply(ticket=ticket, pid=pid)
        with contextlib.suppress(OSError):
            conn.send(ENCODER.encode(reply))

    def _admit(self, conn: socket.socket, data: bytes, fds: list[int], flags: int
               ) -> tuple[bytes, int]:
        """The ticket for `fds`, and the pid the registration must claim."""
        if flags & socket.MSG_TRUNC:
            raise InvalidRequest(f"a handover request is at most {MAX_REQUEST_BYTES} bytes")
        if flags & socket.MSG_CTRUNC:
            # A sender cannot attach more than MAX_FDS (the kernel refuses): the descriptors
            # were cut short because this process had no free descriptor for the rest.
            raise InvalidRequest(f"the server could not take the descriptors handed over "
                                 f"(it took {len(fds)}): it has no descriptor free under its "
                                 f"limit of {self.descriptor_limit}; try again later")
        try:
            request = _DECODER.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidRequest(f"malformed handover request: {exc}") from None
        if self._store is not None:
            self._store.reload(now=True)
            identity = self._store.check_token(request.name, request.token)
            if identity is None:
                # Anyone on the host can connect here: one line per interval.
                refusals_log.warning("handover", "refused a memory handover: unknown "
                                     "credential or wrong token")
                raise InvalidRequest("the server refused this credential")
            credential, tenant = identity.name, identity.tenant
        else:
            credential, tenant = "anonymous", ""
        pid, uid, _ = _peer_credentials(conn)
        # Now, while the worker is connected: its registration may come after it died.
        process = _watch(conn, pid)
        if isinstance(process, PidfdProcess):
            pid = process.pid  # the kernel's figure at this moment, 0 in another namespace
        ticket = secrets.token_bytes(16)
        files = HandedOverFiles(pid, uid, list(fds), process)
        try:
            with self._lock:
                self._check_bounds(uid, tenant, len(fds))
                self._tickets[ticket] = _Ticket(files, credential, tenant,
                                                time.monotonic() + TICKET_TTL)
        except BaseException:
            if isinstance(process, PidfdProcess):
                process.close()  # the caller closes the descriptors handed over
            raise
        return ticket, pid

    def _check_bounds(self, uid: int, tenant: str, count: int) -> None:
        """Refuse `count` more parked descriptors of `uid` and `tenant` past any bound,
        naming the bound that was hit (under the lock)."""
        tickets = self._tickets.values()
        mine = [t for t in tickets if t.files.uid == uid]
        if len(mine) >= MAX_TICKETS_PER_UID:
            raise InvalidRequest(f"uid {uid} holds {MAX_TICKETS_PER_UID} unclaimed handover "
                                 "tickets already, the bound per uid; register with them first")
        held = sum(len(t.files.fds) for t in mine)
        if held + count > MAX_PARKED_FDS_PER_UID:
            raise InvalidRequest(
                f"uid {uid} holds {held} descriptors in unclaimed handover tickets; {count} "
                f"more would pass the bound per uid, {MAX_PARKED_FDS_PER_UID}; register with "
                "those tickets first")
        if tenant:
            held = sum(len(t.files.fds) for t in tickets if t.tenant == tenant)
            if held + count > MAX_PARKED_FDS_PER_TENANT:
                raise InvalidRequest(
                    f"tenant {tenant!r} holds {held} descriptors in unclaimed handover "
                    f"tickets; {count} more would pass the bound per tenant, "
                    f"{MAX_PARKED_FDS_PER_TENANT}; register with those tickets first")
        held = sum(len(t.files.fds) for t in tickets)
        if held + count > self.max_parked_fds:
            raise InvalidRequest(
                f"the server holds {held} descriptors in unclaimed handover tickets; {count} "
                f"more would pass the bound for all users, {self.max_parked_fds} (1/"
                f"{PARKED_FDS_SHARE} of its descriptor limit of {self.descriptor_limit}); "
                f"try again once tickets are claimed or expire ({TICKET_TTL:.0f} s)")

    def _expire(self, now: float) -> None:
        for ticket in [t for t, e in self._tickets.items() if e.expires < now]:
            self._tickets.pop(ticket).files.close()
