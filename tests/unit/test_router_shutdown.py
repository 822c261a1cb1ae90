"""The router's reply path outlives its poll loop until the dispatcher's threads are
done: a store finishing while the server stops replies into nothing, it does not fail on
a socket closed under it (ZeroMQ sockets must never be closed under their thread)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvdepot.protocol import Empty, RequestType
from kvdepot.rpc.auth import Caller
from kvdepot.rpc.router import ReplyFn, RouterServer
from kvdepot.server_process import free_port
from tests.support.raw import RawSocket


class _SlowDispatcher:
    """Every request runs on one pool thread; the first replies at once, the next ones
    only when `release` is set."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1)
        self.release = threading.Event()
        self.started = threading.Event()
        self.futures: list[Future[None]] = []

    def is_slow(self, request_type: RequestType) -> bool:
        return True

    def handle(self, request_type: RequestType, request: Any, caller: Caller) -> Any:
        raise AssertionError("everything is slow here")

    def submit(self, request_type: RequestType, request: Any, reply: ReplyFn,
               caller: Caller) -> None:
        first = not self.futures

        def run() -> None:
            if not first:
                self.started.set()
                self.release.wait()
            reply(None)

        self.futures.append(self.pool.submit(run))

    def tick(self) -> None:
        pass


def test_a_reply_after_the_loop_ended_is_dropped_not_an_error():
    url = f"tcp://127.0.0.1:{free_port()}"
    router = RouterServer(url)
    dispatcher = _SlowDispatcher()
    loop = threading.Thread(target=router.run, args=(dispatcher,))
    loop.start()
    client = RawSocket(url)
    try:
        client.send(1, RequestType.PING, Empty())
        assert client.reply(30) is not None  # this thread's reply socket now exists
        client.send(2, RequestType.PING, Empty())
        assert dispatcher.started.wait(30)
        router.stop()
        loop.join(30)
        dispatcher.release.set()  # the slow request replies after the loop ended
        for future in dispatcher.futures:
            future.result(30)  # raised ZMQError (socket closed under it) before
        dispatcher.pool.shutdown()
        router.close()
    finally:
        client.sock.close(linger=0)
