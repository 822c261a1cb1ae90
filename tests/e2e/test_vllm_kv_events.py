"""Issue 26, items 1, 2 and 4: kvdepot's blocks in vLLM's own KV events. Two real vLLM
engines publish KV events (`kv_events_config`, ZeroMQ) and share one depot; a SUB socket
per engine decodes them with vLLM's own `KVEventBatch` decoder.

A prompt prefilled on engine A and stored in kvdepot is reported by both engines, in CPU
memory and owned by kvdepot, under the same hashes as A's GPU blocks and as engine B's
when B runs the prompt. Dropping vLLM's prefix cache leaves them reported; an operator's
clear of the depot is reported as their removal, by both engines.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvdepot.bench.kv_router import prompt_hasher
from kvdepot.client.admin import AdminClient
from kvdepot.server_process import free_port
from tests.e2e.conftest import BLOCK, CHUNK, DepotServer, Engine, tokens

PROMPT_TOKENS = 2 * CHUNK + 100  # two whole chunks (four vLLM blocks) and a tail
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class Subscriber:
    """A ZeroMQ SUB socket on an engine's KV event publisher."""

    def __init__(self, port: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.events: list = []

    def drain(self, wait: float = 0.5) -> list:
        """Every event received until none has come for `wait` seconds."""
        while self.sock.poll(int(wait * 1000)):
            _, _, payload = self.sock.recv_multipart()
            self.events.extend(DECODER.decode(payload).events)
        return self.events

    def close(self) -> None:
        self.sock.close(linger=0)


def kvdepot_hashes(events: list, kind: type) -> list:
    return [h for e in events if isinstance(e, kind) and e.ownership == "kvdepot"
            and e.medium == "CPU" for h in e.block_hashes]


def gpu_hashes(events: list) -> list:
    return [h for e in events if isinstance(e, BlockStored) and e.medium == "GPU"
            for h in e.block_hashes]


@pytest.fixture(scope="module")
def engines(model_dir: Path, log_dir: Path, server: DepotServer
            ) -> Iterator[list[tuple[Engine, Subscriber]]]:
    started = []
    for name in ("a", "b"):
        port = free_port()
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{port}"}  # "*": the engine binds
        engine = Engine(model_dir, server.url, log_dir / f"engine-events-{name}.log",
                        llm_kwargs={"kv_events_config": events}, wait=False)
        started.append((engine, Subscriber(port)))
    for engine, _ in started:
        engine.wait_ready()
    yield started
    for engine, subscriber in started:
        subscriber.close()
        engine.close()


def steps(engine: Engine, seed: int) -> None:
    """A short request of its own: an engine passes kvdepot's events on at its steps."""
    engine.generate([tokens(seed, 40)], max_tokens=8)


def until(subscriber: Subscriber, engine: Engine, seed: int, done, wait: float = 60) -> list:
    deadline = time.monotonic() + wait
    while not done(subscriber.drain()):
        assert time.monotonic() < deadline, subscriber.events
        steps(engine, seed)
        seed += 1
    return subscriber.events


def test_depot_blocks_carry_the_engines_own_hashes_and_their_removal_is_reported(
        engines, server: DepotServer):
    (engine_a, events_a), (engine_b, events_b) = engines
    prompt = tokens(7, PROMPT_TOKENS)
    engine_a.generate([prompt], max_tokens=4)
    whole = PROMPT_TOKENS // CHUNK * CHUNK // BLOCK  # the blocks kvdepot stores

    seen_a = until(events_a, engine_a, 100,
                   lambda ev: len(kvdepot_hashes(ev, BlockStored)) >= whole)
    stored = kvdepot_hashes(seen_a, BlockStored)
    assert len(stored) == whole
    assert stored == gpu_hashes(seen_a)[:whole]  # A's GPU blocks, the same hashes
    # ... which a router computes from the prompt alone (bench/kv_router.py).
    assert prompt_hasher(BLOCK)(prompt)[:whole] == stored
    depot_events = [e for e in seen_a if isinstance(e, BlockStored) and e.ownership == "kvdepot"]
    assert all(e.block_size == BLOCK and e.token_ids == [] for e in depot_events)

    # B hears of them too (the depot serves every engine of the tenant) ...
    seen_b = until(events_b, engine_b, 200,
                   lambda ev: len(kvdepot_hashes(ev, BlockStored)) >= whole)
    assert kvdepot_hashes(seen_b, BlockStored) == stored
    # ... and its own GPU blocks for the prompt, loaded from kvdepot, have those hashes.
    before = len(events_b.events)
    engine_b.generate([prompt], max_tokens=4)
    assert gpu_hashes(events_b.drain()[before:])[:whole] == stored

    # vLLM drops its prefix cache: kvdepot still holds the blocks, and says nothing.
    engine_a.reset_prefix_cache()
    steps(engine_a, 300)
    assert kvdepot_hashes(events_a.drain(), BlockRemoved) == []

    # The operator clears the depot: both engines report the blocks removed.
    with AdminClient(server.url) as admin:
        assert admin.clear() > 0
    for subscriber, engine, seed in ((events_a, engine_a, 400), (events_b, engine_b, 500)):
        seen = until(subscriber, engine, seed,
                     lambda ev: set(stored) <= set(kvdepot_hashes(ev, BlockRemoved)))
        assert all(e.locality == "LOCAL" for e in seen
                   if isinstance(e, BlockRemoved) and e.ownership == "kvdepot")
