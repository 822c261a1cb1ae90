"""A worker whose server cannot open its CUDA events (another PID or IPC namespace):
it sends each store or retrieve only once the engine's event has completed, from a thread
of its own, and never blocks the engine's thread on it.

CPU engines have no events, so the engine here is the CPU test engine in this process
with a stand-in event the test completes by hand, and the worker told what `_register`
finds out in another namespace; the GPU machine runs the real case
(tests/gpu/test_namespaces_gpu.py).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest

from kvdepot.testbed.server_process import ServerProcess
from tests.support.engine import _Engine
from tests.support.server import stats
from tests.support.waiting import wait_until

CHUNK = 64
BLOCK = 16


class HeldEvent:
    """Completes when the test says so, as an engine's GPU work finishes later."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waited_from: set[str] = set()

    def synchronize(self) -> None:
        self.waited_from.add(threading.current_thread().name)
        assert self.done.wait(30), "the test never completed the event"

    def ipc_handle(self) -> bytes:
        raise AssertionError("a server of another namespace must not get the event")


@pytest.fixture
def engine(server: ServerProcess) -> Iterator[_Engine]:
    made = _Engine(server.url, num_blocks=64)
    made.worker._events_shared = False  # what registering from another namespace finds
    yield made
    made.shutdown()


def test_operations_wait_for_their_event_off_the_engines_thread(
        engine: _Engine, server: ServerProcess) -> None:
    rng = random.Random(5)
    tokens = [rng.randrange(1, 30000) for _ in range(2 * CHUNK + 1)]
    blocks = list(range(8))
    engine.fill_value(blocks, 7.0)
    event = HeldEvent()
    started = time.monotonic()
    engine.worker.submit_store_request("held", engine._op(tokens, blocks, 0, 2 * CHUNK), event)
    assert time.monotonic() - started < 0.5, "the engine's thread waited for its event"
    time.sleep(0.5)
    assert stats(server.url)["stores"] == 0, "the store was sent before its event completed"
    event.done.set()
    wait_until(lambda: "held" in engine.worker.get_finished({"held"})[0], "the store")
    assert stats(server.url)["stored_chunks"] == 2
    assert threading.current_thread().name not in event.waited_from

    # A retrieve the same way, into other blocks: the stored bytes come back.
    assert engine.lookup("back", tokens) == 2 * CHUNK
    target = list(range(8, 16))
    engine.fill_value(target, 0.0)
    loaded = HeldEvent()
    loaded.done.set()
    engine.worker.submit_retrieve_request("back", engine._op(tokens, target, 0, 2 * CHUNK),
                                          loaded)
    wait_until(lambda: "back" in engine.worker.get_finished(set())[1], "the retrieve")
    assert engine.worker.get_block_ids_with_load_errors() == set()
    assert engine.blocks_hold(target, 7.0)
