"""The server side of the transport: a ROUTER socket and its poll loop.

Control requests (lookups, pings, locks) are answered inline on the loop thread, so
they stay fast whatever the data path is doing. Requests the dispatcher marks as
slow (stores, retrieves, registrations) go to its worker threads, which hand their
replies back through an inproc socket: ZeroMQ sockets belong to one thread.

Bad input is answered, never silently dropped, wherever the call id can be read: a
wrong number of frames, an unknown type, a payload that does not decode or is past its
bound all get an error reply. Frames too short to hold a call id are dropped. Either
way the log gets at most one line per kind per interval (`LogLimiter`). Frames larger
than `MAX_MESSAGE_BYTES` never reach us: ZeroMQ disconnects their sender.

With authentication on (`kvdepot.rpc.auth`), a ZAP handler admits each connection and
every message carries its credential's name (ZeroMQ's User-Id property); the router
turns it into the `Caller` the dispatcher gets with each request.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import msgspec
import zmq

from kvdepot.errors import (
    AddressInUse,
    InvalidRequest,
    KVDepotError,
    MalformedPayload,
    PermissionDenied,
    UnknownRequestType,
)
from kvdepot.log_limiter import LogLimiter
from kvdepot.protocol import (
    ENCODER,
    MAX_MESSAGE_BYTES,
    MAX_PAYLOAD_BYTES,
    REPLY_HEADER,
    REQUEST_DECODERS,
    REQUEST_HEADER,
    REQUESTS,
    STATUS_OK,
    ErrorReply,
    Message,
    RequestType,
    describe_validation_error,
)
from kvdepot.rpc.auth import ANONYMOUS, Caller, ServerAuth, ZapHandler
from kvdepot.rpc.connection_guard import ConnectionGuard, harden
from kvdepot.rpc.in_flight import (
    IO_THREADS,
    RECEIVE_BUFFER_BYTES,
    RECEIVE_QUEUE_MESSAGES,
    InFlight,
)

log = logging.getLogger(__name__)
bad_input_log = LogLimiter(log)

_REQUEST_FRAMES = 3
"""The routing id the ROUTER adds, the header and the payload."""

FINAL_REPLIES_LINGER_MS = 1000
"""How long ZeroMQ keeps sending the replies queued when the server stops (the retrieve
that ended a drain, forwarded a moment before): with no linger they were dropped. A
client that does not read bounds it."""

ReplyFn = Callable[[Any], None]
"""Called once with the response value, or with a KVDepotError/Exception."""


class Dispatcher(Protocol):
    def is_slow(self, request_type: RequestType) -> bool: ...

    def handle(self, request_type: RequestType, request: Message, caller: Caller) -> Any:
        """Answer a control request inline; raise KVDepotError for an error reply.
        `caller` names the connection (its routing id: per-connection caps, registration
        binding) and its credential."""

    def submit(self, request_type: RequestType, request: Message, reply: ReplyFn,
               caller: Caller) -> None:
        """Start a slow request on another thread; call `reply` when it is done."""

    def tick(self) -> None:
        """Periodic housekeeping on the loop thread (lock expiry)."""

    def start_threads(self, on_start: Callable[[], object]) -> None:
        """Start every thread that `submit` hands work to, each calling `on_start` first
        (it opens the thread's reply socket), so that the server has every descriptor
        open before it serves: a count that grows later is a leak."""


def encode_reply(call_id: int, outcome: Any) -> list[bytes]:
    if isinstance(outcome, BaseException):
        kind = outcome.kind if isinstance(outcome, KVDepotError) else 1
        message = str(outcome) if isinstance(outcome, KVDepotError) else (
            f"internal server error: {type(outcome).__name__}: {outcome}")
        return [REPLY_HEADER.pack(call_id, int(kind)), ENCODER.encode(ErrorReply(message))]
    return [REPLY_HEADER.pack(call_id, STATUS_OK), ENCODER.encode(outcome)]


class RouterServer:
    TICK_MS = 100

    def __init__(self, url: str, context: zmq.Context | None = None,
                 auth: ServerAuth | None = None) -> None:
        """`auth` None (or its mechanism "null"): no authentication, every caller is admin."""
        self.url = url
        self._dispatcher: Dispatcher
        # Several I/O threads: libzmq gives each new connection the least busy one, so a
        # connection receiving a flood of large messages does not hold up the others'
        # (rpc/in_flight.py). Ignored where the process's shared context exists already.
        self._ctx = context or zmq.Context.instance(io_threads=IO_THREADS)
        self._auth = auth if auth is not None and auth.enabled else None
        self._zap: ZapHandler | None = None
        if self._auth is not None:
            self._zap = ZapHandler(self._ctx, self._auth)
            self._zap.start()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        # Bytes queued per connection: a few of the largest messages (rpc/in_flight.py).
        self._router.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_MESSAGES)
        # And what ZeroMQ's one I/O thread reads per turn, so others' requests interleave.
        self._router.setsockopt(zmq.RCVBUF, RECEIVE_BUFFER_BYTES)
        harden(self._router)  # never-handshaking connections are dropped (connection_guard)
        if self._auth is not None:
            self._auth.configure(self._router)
        try:
            self._router.bind(url)
        except zmq.ZMQError as exc:
            self._router.close()
            if self._zap is not None:
                self._zap.stop()
            if exc.errno == zmq.EADDRINUSE:
                raise AddressInUse(f"cannot listen on {url}: the address is already in use "
                                   "(another kvdepot server?)") from None
            raise AddressInUse(f"cannot listen on {url}: {exc}") from None
        # Bounds each peer's connections (descriptors) before any handshake is read.
        self._guard = ConnectionGuard(self._router, "request")
        self._inbox_url = f"inproc://kvdepot-replies-{id(self)}"
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.bind(self._inbox_url)
        self._local = threading.local()
        self._senders: list[zmq.Socket] = []
        self._senders_lock = threading.Lock()
        self._in_flight = InFlight()
        self._stop = threading.Event()
        # Work other threads hand to the loop (`call_in_loop`); a byte on this socket pair
        # wakes the poll, which any thread may write without a ZeroMQ socket of its own.
        self._tasks: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue())
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)

    def stop(self) -> None:
        self._stop.set()
        self._wake()  # the loop ends now rather than at its next tick

    def _wake(self) -> None:
        """Make the loop's poll return. A full pipe holds wake-ups already; a closed one
        means the loop has ended."""
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"\0")

    def call_in_loop(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the loop thread, between requests, and resolve the future with what
        it returns or raises: how other threads read or change what the loop owns without
        a lock. Callable from any thread; after the loop ended the future is cancelled."""
        future: Future[Any] = Future()
        if self._stop.is_set():
            future.cancel()
            return future
        self._tasks.put((fn, future))
        self._wake()
        return future

    def _run_tasks(self) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError: drained
            while self._wake_reader.recv(4096):
                pass
        while True:
            try:
                fn, future = self._tasks.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller decides what a failure means
                future.set_exception(exc)

    def _thread_sender(self) -> zmq.Socket:
        sender = getattr(self._local, "sender", None)
        if sender is None:
            sender = self._ctx.socket(zmq.PUSH)
            sender.setsockopt(zmq.LINGER, 0)
            sender.connect(self._inbox_url)
            self._local.sender = sender
            with self._senders_lock:
                self._senders.append(sender)
        return sender

    def listen_also(self, url: str) -> None:
        """Accept connections on `url` too (an ipc:// path engines of other network
        namespaces reach), under the same authentication and bounds."""
        try:
            self._router.bind(url)
        except zmq.ZMQError as exc:
            raise AddressInUse(f"cannot listen on {url}: {exc}") from None

    def run(self, dispatcher: Dispatcher) -> None:
        """Serve until `stop()`; binding happened in the constructor, so a taken port fails
        before the caller spends time on anything else."""
        self._dispatcher = dispatcher
        dispatcher.start_threads(self._thread_sender)
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._inbox, zmq.POLLIN)
        poller.register(self._wake_reader, zmq.POLLIN)
        wake_fd = self._wake_reader.fileno()  # the poller reports plain sockets by descriptor
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(self.TICK_MS))
                if self._inbox in ready:
                    self._forward_replies()
                if self._router in ready:
                    self._serve_requests()
                if wake_fd in ready:
                    self._run_tasks()
                self._dispatcher.tick()
                if self._auth is not None and self._auth.store is not None:
                    self._auth.store.reload()
            self._forward_replies()  # of work that ended just before the stop
        finally:
            self._stop.set()
            while not self._tasks.empty():
                self._tasks.get_nowait()[1].cancel()
            self._wake_reader.close()
            self._wake_writer.close()
            self._guard.close_socket(FINAL_REPLIES_LINGER_MS)
            self._guard.stop()
            if self._zap is not None:
                self._zap.stop()

    def close(self) -> None:
        """Close the reply path, once the dispatcher's threads have ended (`run` has
        returned and the dispatcher is closed): a thread may still be replying until then,
        and a ZeroMQ socket must not be closed under the thread using it."""
        with self._senders_lock:
            for sender in self._senders:
                sender.close(linger=0)
            self._senders.clear()
        self._inbox.close(linger=0)

    def _forward_replies(self) -> None:
        while True:
            try:
                frames = self._inbox.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._send(frames)

    def _send(self, frames: list[bytes]) -> None:
        try:
            self._router.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            log.debug("dropped a reply to a client that went away")

    def _serve_requests(self) -> None:
        for _ in range(256):  # bounded so replies from worker threads are not starved
            try:
                frames, extra = self._receive()
            except zmq.Again:
                return
            self._serve_one(frames, extra)

    def _receive(self) -> tuple[list[zmq.Frame], int]:
        """One message: its first frames, and how many more were read and dropped (a
        request has three; ZeroMQ delivers all of a message's frames at once). Frames,
        not bytes: only a frame tells the credential (User-Id) it came with, and the
        payload is decoded without a copy."""
        frames = [self._router.recv(flags=zmq.NOBLOCK, copy=False)]
        extra = 0
        while self._router.getsockopt(zmq.RCVMORE):
            frame = self._router.recv(copy=False)
            if len(frames) < _REQUEST_FRAMES:
                frames.append(frame)
            else:
                extra += 1
        return frames, extra

    def _caller(self, routing_id: bytes, frame: zmq.Frame) -> Caller | None:
        """The sender of `frame`, None if its credential was revoked. With --insecure the
        routing id alone names the connection (a client may choose it: everyone is
        trusted there anyway)."""
        if self._auth is None:
            return Caller(routing_id, ANONYMOUS)
        assert self._auth.store is not None
        return self._auth.store.caller(routing_id, frame.get("User-Id"))

    def _reject(self, identity: bytes, call_id: int, kind: str, error: KVDepotError) -> None:
        bad_input_log.warning(kind, "rejected a request: %s", error)
        self._send([identity, *encode_reply(call_id, error)])

    def _serve_one(self, message: list[zmq.Frame], extra: int) -> None:
        identity = message[0].bytes
        if len(message) < 2 or len(message[1]) != REQUEST_HEADER.size:
            bad_input_log.warning("not-a-request", "dropped a message that is not a kvdepot "
                                  "request (%d frames, no %d-byte header)",
                                  len(message) + extra, REQUEST_HEADER.size)
            return
        call_id, raw_type = REQUEST_HEADER.unpack(message[1].bytes)
        if len(message) != _REQUEST_FRAMES or extra:
            self._reject(identity, call_id, "frames", MalformedPayload(
                f"a kvdepot request is {_REQUEST_FRAMES - 1} frames (header, payload); got "
                f"{len(message) - 1 + extra}"))
            return
        caller = self._caller(identity, message[1])
        if caller is None:  # removed from the state directory since the handshake
            self._reject(identity, call_id, "revoked", PermissionDenied(
                "this connection's credential has been revoked"))
            return
        frames = [identity, message[1].bytes, message[2].buffer]
        try:
            request_type = RequestType(raw_type)
        except ValueError:
            self._reject(identity, call_id, "unknown-type", UnknownRequestType(
                f"unknown request type {raw_type}; this server speaks types "
                f"{[int(t) for t in RequestType]}"))
            return
        limit = MAX_PAYLOAD_BYTES.get(request_type, MAX_MESSAGE_BYTES)
        if len(frames[2]) > limit:
            self._reject(identity, call_id, "too-large", MalformedPayload(
                f"a {request_type.name} payload is at most {limit} bytes; got {len(frames[2])}"))
            return
        try:
            request = REQUEST_DECODERS[request_type].decode(frames[2])
        except msgspec.ValidationError as exc:
            self._reject(identity, call_id, "malformed", MalformedPayload(
                f"malformed {request_type.name} payload: "
                f"{describe_validation_error(REQUESTS[request_type].request, exc)}"))
            return
        except msgspec.DecodeError as exc:
            self._reject(identity, call_id, "malformed", MalformedPayload(
                f"malformed {request_type.name} payload: {exc}"))
            return
        if self._dispatcher.is_slow(request_type):
            # The request holds its frame (decoded without a copy) until it is answered.
            nbytes = len(frames[2])
            if not self._in_flight.admit(identity, nbytes):
                self._reject(identity, call_id, "in-flight", InvalidRequest(
                    self._in_flight.refusal(identity, nbytes)))
                return

            def reply(outcome: Any) -> None:
                self._in_flight.release(identity, nbytes)
                try:
                    # Never blocks: after `run` no one reads the inbox, and a server that is
                    # stopping drops late replies (their clients see the connection end).
                    self._thread_sender().send_multipart(
                        [identity, *encode_reply(call_id, outcome)], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    log.debug("dropped a reply: the server is stopping")

            self._dispatcher.submit(request_type, request, reply, caller)
            return
        try:
            outcome = self._dispatcher.handle(request_type, request, caller)
        except Exception as exc:  # every failure becomes an error reply
            if not isinstance(exc, KVDepotError):
                log.exception("%s handler failed", request_type.name)
            outcome = exc
        self._send([identity, *encode_reply(call_id, outcome)])
        # An error's traceback holds this frame and so the request's frames: end the cycle
        # now rather than at the garbage collector's next pass (see Depot.submit).
        del outcome
