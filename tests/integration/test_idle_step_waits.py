"""A step that computes nothing waits for the pending asynchronous loads within it
(`WorkerClient.wait_for_retrieves`), so an idle engine reports a load in the step that
started it instead of spinning empty steps until a poll finds it: against a real server,
answered and stalled."""

from __future__ import annotations

import os
import random
import signal
import time

from tests.support.engine import locked_for_a_load
from tests.support.waiting import wait_until

CHUNK = 64


def prompt(seed: int, chunks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(chunks * CHUNK + 1)]


def test_the_step_reports_the_load_it_waited_for(engines, server):
    engine = engines(heartbeat_interval=1.0, num_blocks=64)
    tokens = prompt(1, 2)
    targets = locked_for_a_load(engine, tokens, 3.0, CHUNK)
    engine.submit_retrieve("load", tokens, targets, 0, 2 * CHUNK)
    engine.call("worker", "wait_for_retrieves", 5.0)
    _sending, recving = engine.call("worker", "get_finished", set())
    assert recving == {"load"}
    assert not engine.call("worker", "get_block_ids_with_load_errors")
    assert engine.blocks_hold(targets, 3.0)


def test_a_stalled_load_is_waited_for_once_then_polled_as_before(engines, server):
    """A stopped server costs an idle engine one wait per load, not one per step; the load
    stays pending (never reported while the server may still write it) and, once the
    server goes on, is reported with the stored bytes in its blocks."""
    engine = engines(heartbeat_interval=30.0, num_blocks=64)
    tokens = prompt(2, 2)
    targets = locked_for_a_load(engine, tokens, 5.0, CHUNK)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        engine.submit_retrieve("load", tokens, targets, 0, 2 * CHUNK)
        started = time.monotonic()
        engine.call("worker", "wait_for_retrieves", 0.5)
        first = time.monotonic() - started
        started = time.monotonic()
        engine.call("worker", "wait_for_retrieves", 0.5)
        second = time.monotonic() - started
        _sending, recving = engine.call("worker", "get_finished", set())
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert 0.5 <= first < 5, first
    assert second < 0.2, second
    assert "load" not in recving
    received: set[str] = set()

    def reported() -> bool:
        received.update(engine.call("worker", "get_finished", set())[1])
        return "load" in received

    wait_until(reported, what="the load reported once the server went on")
    assert not engine.call("worker", "get_block_ids_with_load_errors")
    assert engine.blocks_hold(targets, 5.0)
