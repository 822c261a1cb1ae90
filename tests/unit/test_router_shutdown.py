"""The router's reply path outlives its poll loop until the dispatcher's threads are
done: a store finishing while the server stops replies into nothing, it does not fail on
a socket closed under it (ZeroMQ sockets must never be closed under their thread)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import zmq

from kvdepot.protocol import ENCODER, REQUEST_HEADER, Empty, RequestType
from kvdepot.rpc.auth import Caller
from kvdepot.rpc.router import ReplyFn, RouterServer
from kvdepot.testbed.server_process import free_port


class _PoolDispatcher:
    """Every request is slow: it runs on one pool thread, whose reply socket exists
    before the loop serves."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1)

    def is_slow(self, request_type: RequestType) -> bool:
        return True

    def handle(self, request_type: RequestType, request: Any, caller: Caller) -> Any:
        raise AssertionError("everything is slow here")

    def tick(self) -> None:
        pass

    def start_threads(self, on_start: Any) -> None:
        self.pool.submit(on_start).result()


class _SlowDispatcher(_PoolDispatcher):
    """The first request replies at once, the next ones only when `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.started = threading.Event()
        self.futures: list[Future[None]] = []

    def submit(self, request_type: RequestType, request: Any, reply: ReplyFn,
               caller: Caller) -> None:
        first = not self.futures

        def run() -> None:
            if not first:
                self.started.set()
                self.release.wait()
            reply(None)

        self.futures.append(self.pool.submit(run))


def test_a_reply_after_the_loop_ended_is_dropped_not_an_error():
    url = f"tcp://127.0.0.1:{free_port()}"
    router = RouterServer(url)
    dispatcher = _SlowDispatcher()
    loop = threading.Thread(target=router.run, args=(dispatcher,))
    loop.start()
    # A bare DEALER (the router runs without authentication here, whatever owner
    # credential an earlier server left for this port).
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.connect(url)
    ping = [REQUEST_HEADER.pack(1, RequestType.PING), ENCODER.encode(Empty())]
    try:
        client.send_multipart(ping)
        assert client.poll(30_000)  # answered: this thread's reply socket now exists
        client.recv_multipart()
        client.send_multipart(ping)
        assert dispatcher.started.wait(30)
        router.stop()
        loop.join(30)
        dispatcher.release.set()  # the slow request replies after the loop ended
        for future in dispatcher.futures:
            future.result(30)  # raised ZMQError (socket closed under it) before
        dispatcher.pool.shutdown()
        router.close()
    finally:
        client.close(linger=0)


class _StopAfterReply(_PoolDispatcher):
    """Replies to one request with `payload`, and the loop stops at its next tick, as
    when that reply's transfer was the last one a drain waited for."""

    def __init__(self, router: RouterServer, payload: bytes) -> None:
        super().__init__()
        self.router = router
        self.payload = payload
        self.replied = threading.Event()

    def submit(self, request_type: RequestType, request: Any, reply: ReplyFn,
               caller: Caller) -> None:
        def run() -> None:
            reply(self.payload)
            self.replied.set()

        self.pool.submit(run)

    def tick(self) -> None:
        if self.replied.is_set():
            self.router.stop()


def test_the_reply_that_ends_the_loop_is_still_sent_whole():
    url = f"tcp://127.0.0.1:{free_port()}"
    router = RouterServer(url)
    # Large enough that ZeroMQ is still sending it when the socket closes (with no linger
    # it was dropped: the client never got it).
    payload = bytes(range(256)) * (256 << 10)  # 64 MiB
    dispatcher = _StopAfterReply(router, payload)
    loop = threading.Thread(target=router.run, args=(dispatcher,))
    loop.start()
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.connect(url)
    try:
        client.send_multipart([REQUEST_HEADER.pack(1, RequestType.PING), ENCODER.encode(Empty())])
        loop.join(30)
        assert not loop.is_alive()
        assert client.poll(10_000), "the last reply was dropped"
        _header, body = client.recv_multipart()
        assert msgspec.msgpack.decode(body) == payload
        dispatcher.pool.shutdown()
        router.close()
    finally:
        client.close(linger=0)
