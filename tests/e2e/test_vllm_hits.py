"""A real vLLM engine reusing KV through kvdepot: hits, partial hits, salts, two engines,
and kvdepot's blocks in the engines' own KV events (issue 26)."""

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvdepot.client.admin import AdminClient
from kvdepot.testbed.kv_router import prompt_hasher
from kvdepot.testbed.server_process import free_port
from tests.e2e.support.harness import (
    BLOCK,
    CHUNK,
    DepotServer,
    Engine,
    assert_same_output,
    close_engines,
    cold,
    delta,
    eventually,
    tokens,
)

EVENTS_DECODER = msgspec.msgpack.Decoder(KVEventBatch)

# Each test may start engines (about a minute each on two cores).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


class Subscriber:
    """A ZeroMQ SUB socket on an engine's KV event publisher, decoding with vLLM's own
    `KVEventBatch` decoder."""

    def __init__(self, port: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.events: list = []

    def drain(self, wait: float = 0.5) -> list:
        """Every event received so far, until none has come for `wait` seconds."""
        while self.sock.poll(int(wait * 1000)):
            _, _, payload = self.sock.recv_multipart()
            self.events.extend(EVENTS_DECODER.decode(payload).events)
        return self.events

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture(scope="module")
def engines(model_dir: Path, server: DepotServer, log_dir: Path
            ) -> Iterator[dict[str, Engine]]:
    """Three engine processes on one server, started at once: a kv_both engine (most
    tests'), a kv_consumer and a kv_producer. The first two publish KV events (vLLM binds
    each publisher's port), read by `subscribers`."""
    ports = {"kv_both": free_port(), "kv_consumer": free_port()}
    started = {role: Engine(model_dir, server.url, log_dir / f"engine-{role}.log",
                            kv_role=role, wait=False,
                            llm_kwargs={"kv_events_config": {
                                "enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": f"tcp://*:{ports[role]}"}} if role in ports else None)
               for role in ("kv_both", "kv_consumer", "kv_producer")}
    for role, port in ports.items():
        started[role].subscriber = Subscriber(port)  # type: ignore[attr-defined]
    try:
        for engine in started.values():
            engine.wait_ready()
        yield started
    finally:
        for role in ports:
            started[role].subscriber.close()  # type: ignore[attr-defined]
        close_engines(*started.values())


@pytest.fixture(scope="module")
def engine(engines: dict[str, Engine]) -> Engine:
    return engines["kv_both"]


def test_the_model_output_depends_on_the_prompt(engine: Engine) -> None:
    # Without this the equality checks below could pass on garbage KV.
    base = tokens(1, 3 * CHUNK + 40)
    changed = [base[0] + 1, *base[1:]]
    a, b = cold(engine, base), cold(engine, changed)
    assert a["logprobs"] != pytest.approx(b["logprobs"], abs=1e-3)


def test_hit_gives_the_cold_output(engine: Engine, server: DepotServer) -> None:
    prompt = tokens(2, 3 * CHUNK + 77)
    reference = cold(engine, prompt)

    engine.reset_prefix_cache()
    before = server.stats()
    first = engine.generate([prompt])[0]  # computes and stores 3 chunks and a 77-token tail
    # vLLM returns the output before the store has necessarily landed.
    mid = eventually(server, lambda s: delta(s, before, "stored_chunks") == 3
                     and delta(s, before, "stored_tails") == 1)
    assert_same_output(first, reference)

    engine.reset_prefix_cache()  # the next run can only hit kvdepot
    second = engine.generate([prompt])[0]
    after = server.stats()
    assert_same_output(second, reference)
    assert delta(after, mid, "hit_tokens") == 3 * CHUNK + 77
    assert delta(after, mid, "retrieved_chunks") == 3

    # vLLM's own prefix cache now holds the prompt again: repeated scheduler
    # calls and a local hit must not count or load anything twice.
    third = engine.generate([prompt])[0]
    assert_same_output(third, reference)
    assert delta(server.stats(), after, "retrieved_chunks") == 0


def test_vllms_own_hit_sends_the_server_nothing(engine: Engine, server: DepotServer) -> None:
    """vLLM holds every whole chunk of the prompt: no lookup (nothing more could load),
    and no store of the chunks it holds, which went to the server when it computed them."""
    prompt = tokens(13, 2 * CHUNK + 1)
    reference = cold(engine, prompt)
    engine.reset_prefix_cache()
    before = server.stats()
    engine.generate([prompt])
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 2)

    before = server.stats()
    again = engine.generate([prompt])[0]
    assert_same_output(again, reference)
    # A request after it that stores one chunk: once that store has landed, one sent
    # before it on the same connection would have too.
    engine.generate([tokens(14, CHUNK + 1)])
    after = eventually(server, lambda s: delta(s, before, "stored_chunks") == 1)
    assert delta(after, before, "lookups") == 1  # the second request's
    assert delta(after, before, "stores") == 1
    assert delta(after, before, "store_present_chunks") == 0


def test_a_tail_hit_gives_the_cold_output(engine: Engine, server: DepotServer) -> None:
    """A prompt that ends mid-chunk: its tokens past the last whole chunk are stored
    as a tail and loaded on a hit; a chat's next turn loads that tail too."""
    prompt = tokens(11, 2 * CHUNK + BLOCK + 72)  # 2 chunks, a tail of 1.56 blocks
    reference = cold(engine, prompt)
    engine.reset_prefix_cache()
    before = server.stats()
    engine.generate([prompt])
    mid = eventually(server, lambda s: delta(s, before, "stored_chunks") == 2
                     and delta(s, before, "stored_tails") == 1)

    engine.reset_prefix_cache()
    out = engine.generate([prompt])[0]
    after = server.stats()
    assert_same_output(out, reference)
    assert delta(after, mid, "hit_tokens") == 2 * CHUNK + BLOCK + 72
    assert delta(after, mid, "retrieved_tails") == 1

    # The next turn runs on through the tail's chunk: it loads the tail, computes the rest.
    turn2 = prompt + tokens(12, CHUNK)
    reference2 = cold(engine, turn2)
    engine.reset_prefix_cache()
    before = server.stats()
    out2 = engine.generate([turn2])[0]
    assert_same_output(out2, reference2)
    after = server.stats()
    assert delta(after, before, "hit_tokens") == 2 * CHUNK + BLOCK + 72
    assert delta(after, before, "hit_tails") == 1


def test_shared_first_part_loads_exactly_the_shared_chunks(
    engine: Engine, server: DepotServer
) -> None:
    document = tokens(3, 4 * CHUNK + 10)
    engine.reset_prefix_cache()
    before = server.stats()
    engine.generate([document])  # stores chunks 0-3
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 4)

    # Same first 2 chunks and a bit, then a different continuation.
    question = document[: 2 * CHUNK + 90] + tokens(4, CHUNK + 30)
    reference = cold(engine, question)
    engine.reset_prefix_cache()
    before = server.stats()
    out = engine.generate([question])[0]
    after = server.stats()
    assert_same_output(out, reference)
    assert delta(after, before, "hit_tokens") == 2 * CHUNK
    assert delta(after, before, "retrieved_chunks") == 2


def test_local_prefix_hit_loads_only_the_chunks_beyond_it(
    engine: Engine, server: DepotServer
) -> None:
    document = tokens(5, 4 * CHUNK + 20)
    engine.reset_prefix_cache()
    before = server.stats()
    engine.generate([document])  # stores chunks 0-3
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 4)
    reference = cold(engine, document)

    # vLLM's prefix cache holds the first 1.5 chunks (3 blocks) only.
    engine.reset_prefix_cache()
    engine.generate([document[: 3 * BLOCK + 5]], max_tokens=1)
    before = server.stats()
    out = engine.generate([document])[0]
    after = server.stats()
    assert_same_output(out, reference)
    # Chunk 0 lies in vLLM's cache and is not read; chunk 1 straddles it and is
    # read without writing its shared block; chunks 2-3 are read whole.
    assert delta(after, before, "retrieved_chunks") == 3


def test_cache_salts_never_share_entries(engine: Engine, server: DepotServer) -> None:
    prompt = tokens(6, 3 * CHUNK + 5)
    reference = cold(engine, prompt)
    engine.reset_prefix_cache()
    before = server.stats()
    engine.generate([prompt], salt="tenant-a")  # stored under tenant-a
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 3)

    engine.reset_prefix_cache()
    before = server.stats()
    other = engine.generate([prompt], salt="tenant-b")[0]
    mid = server.stats()
    assert delta(mid, before, "hit_tokens") == 0
    assert delta(mid, before, "retrieved_chunks") == 0
    assert_same_output(other, reference)

    engine.reset_prefix_cache()
    same = engine.generate([prompt], salt="tenant-a")[0]
    assert delta(server.stats(), mid, "hit_tokens") == 3 * CHUNK
    assert_same_output(same, reference)


def test_second_engine_process_hits_what_the_first_stored(
    engine: Engine, engines: dict[str, Engine], server: DepotServer
) -> None:
    prompt = tokens(7, 3 * CHUNK + 33)
    engine.reset_prefix_cache()
    before = server.stats()
    first = engine.generate([prompt])[0]
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 3
               and delta(s, before, "stored_tails") == 1)

    before = server.stats()
    second = engines["kv_consumer"].generate([prompt])[0]
    after = server.stats()
    assert delta(after, before, "hit_tokens") == 3 * CHUNK + 33
    assert delta(after, before, "retrieved_chunks") == 3
    assert_same_output(second, first)


def test_kv_roles_consumer_never_stores_producer_never_loads(
    engine: Engine, engines: dict[str, Engine], server: DepotServer
) -> None:
    shared = tokens(8, 3 * CHUNK + 12)
    engine.reset_prefix_cache()
    before = server.stats()
    reference = engine.generate([shared])[0]  # kv_both engine stores it
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 3)

    consumer, producer = engines["kv_consumer"], engines["kv_producer"]
    mid = server.stats()
    loaded = consumer.generate([shared, tokens(9, 3 * CHUNK + 12)])[0]
    time.sleep(1)  # a store, were one sent, would have landed by now
    after_consumer = server.stats()
    produced = producer.generate([shared, tokens(10, 3 * CHUNK + 12)])[0]
    after_producer = eventually(
        server, lambda s: delta(s, after_consumer, "stored_chunks") == 3
    )
    assert_same_output(loaded, reference)
    assert delta(after_consumer, mid, "hit_tokens") == 3 * CHUNK
    assert delta(after_consumer, mid, "stores") == 0
    assert_same_output(produced, reference)
    assert delta(after_producer, after_consumer, "lookups") == 0
    assert delta(after_producer, after_consumer, "retrieves") == 0


def kvdepot_hashes(events: list, kind: type) -> set:
    return {h for e in events if isinstance(e, kind) and e.ownership == "kvdepot"
            and e.medium == "CPU" for h in e.block_hashes}


def gpu_hashes(events: list) -> set:
    return {h for e in events if isinstance(e, BlockStored) and e.medium == "GPU"
            for h in e.block_hashes}


def until(engine: Engine, seed: int, done, wait: float = 180) -> list:
    """The engine's events once `done(events)` holds, running short requests of its own
    meanwhile: an engine passes kvdepot's events on at its steps. `wait` bounds a failure,
    not a speed: under the full suite's load on two cores, 60 s once passed with no event
    at all from an engine whose events came within seconds alone (2026-12-07)."""
    deadline = time.monotonic() + wait
    while not done(engine.subscriber.drain()):  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, engine.subscriber.events  # type: ignore[attr-defined]
        engine.generate([tokens(seed, 40)], max_tokens=4)
        seed += 1
    return engine.subscriber.events  # type: ignore[attr-defined]


def test_depot_blocks_are_in_the_engines_kv_events_under_their_own_hashes(
        engines: dict[str, Engine], server: DepotServer) -> None:
    """Issue 26, item 4 (last in this module: it clears the depot). A prompt engine A
    prefilled and kvdepot stored is reported by A and by a second engine B, in CPU memory
    and owned by kvdepot, under the hashes of A's GPU blocks, of B's when B runs it, and of
    a router's hashing (testbed/kv_router.py); a reset of vLLM's prefix cache leaves them
    reported, and a clear of the depot is reported as their removal by both engines."""
    engine_a, engine_b = engines["kv_both"], engines["kv_consumer"]
    prompt = tokens(70, 2 * CHUNK + 100)
    whole = 2 * CHUNK // BLOCK  # the blocks kvdepot stores
    expected = prompt_hasher(BLOCK)(prompt)[:whole]
    engine_a.generate([prompt], max_tokens=4)
    seen_a = until(engine_a, 100, lambda ev: set(expected) <= kvdepot_hashes(ev, BlockStored))
    assert set(expected) <= gpu_hashes(seen_a)  # A's GPU blocks, the same hashes
    depot = [e for e in seen_a if isinstance(e, BlockStored) and e.ownership == "kvdepot"
             and set(e.block_hashes) <= set(expected)]
    assert all(e.block_size == BLOCK and e.token_ids == [] and e.locality == "LOCAL"
               for e in depot)

    until(engine_b, 200, lambda ev: set(expected) <= kvdepot_hashes(ev, BlockStored))
    before = len(engine_b.subscriber.drain())  # type: ignore[attr-defined]
    engine_b.generate([prompt], max_tokens=4)  # loaded from kvdepot
    assert set(expected) <= gpu_hashes(engine_b.subscriber.drain()[before:])  # type: ignore[attr-defined]

    engine_a.reset_prefix_cache()
    engine_a.generate([tokens(300, 40)], max_tokens=4)
    assert not set(expected) & kvdepot_hashes(engine_a.subscriber.drain(), BlockRemoved)  # type: ignore[attr-defined]

    with AdminClient(server.url) as admin:
        assert admin.clear() > 0
    for engine, seed in ((engine_a, 400), (engine_b, 500)):
        until(engine, seed, lambda ev: set(expected) <= kvdepot_hashes(ev, BlockRemoved))
