"""The connector inside one vLLM release's own scheduler, against a real kvdepot server.

Not collected by `make test` itself: `test_vllm_releases.py` runs this file once per
release, in a child pytest whose PYTHONPATH puts that release's Python files before the
.venv's packages (torch, transformers, ...). The server's address and the model folder
come in the environment (`KVDEPOT_RELEASE_URL`, `KVDEPOT_RELEASE_MODEL`).

If the release does not import here, every test is skipped with the import's error as the
reason, which the parent reports as that release's skip.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    import msgspec
    import vllm
    import zmq
    from vllm.distributed import kv_events as vllm_kv_events
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.request import RequestStatus

    from kvdepot.testbed.server_process import free_port
    from tests.vllm_releases.engine import HEAD_DIM, Engine
except Exception as exc:  # what a release lacks or breaks, said as the skip's reason
    pytest.skip(f"does not import: {exc!r}", allow_module_level=True)

URL = os.environ.get("KVDEPOT_RELEASE_URL", "")
MODEL = Path(os.environ.get("KVDEPOT_RELEASE_MODEL", "."))
RELEASE = vllm.__version__
CHUNK = 64
"""The parent's server's chunk size (four of the engines' 16-token blocks)."""


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(f"{RELEASE}/{seed}")
    return [rng.randrange(10, 30_000) for _ in range(n)]


def identity(name: str) -> str:
    """A key scope of this test and release alone: releases run at once on one server."""
    return f"release-{RELEASE}-{name}-{os.getpid()}"


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.shutdown()


@pytest.mark.parametrize("inline", [True, False], ids=["synchronous", "asynchronous"])
def test_requests_are_stored_then_loaded_into_the_right_blocks(engines: list[Engine],
                                                               inline: bool) -> None:
    """New and running requests, a finished one whose stores hold its blocks, and a later
    request of the same prompt loading every whole chunk into blocks vLLM gave it: on an
    idle engine synchronously (in the step that computes it), and with `inline_loads` off
    asynchronously (the request waits for its load)."""
    engine = Engine(MODEL, URL, identity(f"hit-{inline}"),
                    extra={"kvdepot.inline_loads": inline})
    engines.append(engine)
    tokens = prompt(1, 200)
    first = engine.add("first", tokens, max_tokens=3)
    other = engine.add("other", prompt(2, 90), max_tokens=5)
    engine.run(lambda: not engine.scheduler.requests)  # finished, and stores done
    assert first.is_finished() and other.is_finished()
    assert engine.scheduler.reset_prefix_cache()  # vLLM's cache emptied...
    engine.forget_kv()  # ...and its blocks reused: what the next request holds, it loaded

    again = engine.add("again", tokens, max_tokens=3)
    engine.run(lambda: len(again.output_token_ids) >= 1)
    # Three whole chunks (the 8 tokens past them are too few for a tail).
    assert (engine.inline_loads if inline else engine.loading) == {"again": 3 * CHUNK}
    assert not (engine.loading if inline else engine.inline_loads)
    assert engine.written_correctly("again", len(tokens))
    engine.run(lambda: not engine.scheduler.requests)
    # Loads and stores happen once per step: vLLM never calls a per-layer hook of ours.
    assert engine.layer_hooks_asked and not any(engine.layer_hooks_asked)


def test_vllm_calls_a_connectors_layer_hooks_only_when_it_has_metadata() -> None:
    """What lets kvdepot spare each attention layer of each step two calls: this
    release's gate around a layer asks `has_connector_metadata` first."""
    import inspect

    from vllm.model_executor.layers.attention import kv_transfer_utils

    gate = inspect.getsource(kv_transfer_utils.maybe_transfer_kv_layer)
    assert "not connector.has_connector_metadata()" in gate
    assert gate.index("has_connector_metadata") < gate.index("wait_for_layer_load")


def test_an_engine_asked_for_one_token_at_a_time_never_tops_up_its_own_hits(
        engines: list[Engine]) -> None:
    """Every request asks for one token, under asynchronous scheduling: each ends with its
    prefill, so no gap between builds times one. Its end does (`PrefillRate.finished`):
    then vLLM's own hit of a prompt it holds all but the last block of computes those few
    tokens rather than loading them from the tail kvdepot holds."""
    engine = Engine(MODEL, URL, identity("one-token"), async_scheduling=True)
    engines.append(engine)
    tokens = prompt(12, 3 * CHUNK + 40)  # vLLM holds 14 of its 15 blocks; kvdepot all
    engine.add("first", tokens, max_tokens=1)
    engine.run(lambda: not engine.scheduler.requests)  # finished, and stores done
    assert engine.scheduler.connector._scheduler._prefill.tokens_per_s is not None
    again = engine.add("again", tokens, max_tokens=1)
    engine.run(lambda: again.is_finished())
    # Had vLLM not held it, the lookup would have found the whole prompt and loaded it.
    assert not engine.loading and not engine.inline_loads
    engine.run(lambda: not engine.scheduler.requests)


@pytest.mark.parametrize("waits", [True, False], ids=["idle-step-waits", "inline-loads-off"])
def test_with_asynchronous_scheduling_an_idle_engine_loads_asynchronously(
        engines: list[Engine], waits: bool) -> None:
    """vLLM's asynchronous scheduling (its default on GPUs) schedules a request's next
    step before the step that loaded it reports: on an H100 with vLLM 0.26 a synchronous
    load that failed let the request go on from KV nothing wrote. So there every load is
    asynchronous, also on an idle engine, and the request waits for it. The step that
    starts it computes nothing, so the worker waits for the copy within it and reports it
    there: the request waits one step, not the steps of polls after the copy (with
    `inline_loads` off, as before). Without a staging area, which would load it
    synchronously (the next checks)."""
    engine = Engine(MODEL, URL, identity(f"hit-async-scheduling-{waits}"), async_scheduling=True,
                    extra={"kvdepot.inline_loads": waits, "kvdepot.staging_mib": 0})
    engines.append(engine)
    # vLLM's batch queue holds two steps here: a step is timed by the gap after the next
    # build (prefill_rate.py), or a prefill would seem to take no time at all.
    assert engine.scheduler.connector._scheduler._prefill._steps_in_flight == 2
    tokens = prompt(1, 200)
    first = engine.add("first", tokens, max_tokens=3)
    engine.run(lambda: not engine.scheduler.requests)
    assert first.is_finished()
    assert engine.scheduler.reset_prefix_cache()
    engine.forget_kv()
    engine.waiting_steps.clear()  # steps while the first request's stores ran: no loads
    again = engine.add("again", tokens, max_tokens=3)
    engine.run(lambda: len(again.output_token_ids) >= 1)
    assert engine.loading == {"again": 3 * CHUNK}
    assert not engine.inline_loads
    assert engine.written_correctly("again", len(tokens))
    if waits:
        assert engine.load_steps == {"again": 1}
        # The step that planned it; a step before, waiting on the lookup, had no load.
        assert engine.waiting_steps.count(True) == 1
    else:
        assert engine.load_steps["again"] >= 1 and not any(engine.waiting_steps)
    engine.run(lambda: not engine.scheduler.requests)


def _stored_and_forgotten(engine: Engine, prompts: dict[str, list[int]]) -> None:
    """Run `prompts` to their end (stores done), then empty vLLM's prefix cache and zero
    the KV memory: what a request holds afterwards, it loaded or computed."""
    for name, tokens in prompts.items():
        engine.add(name, tokens, max_tokens=2)
    engine.run(lambda: not engine.scheduler.requests)
    assert engine.scheduler.reset_prefix_cache()
    engine.forget_kv()


def test_with_asynchronous_scheduling_an_idle_engine_stages_its_hit(
        engines: list[Engine]) -> None:
    """Where the scheduler shares the worker's process, an idle engine's hit is copied into
    the worker's staging area before vLLM hears of it, so vLLM loads it synchronously: the
    request never waits for remote KV, is computed in the step that plans its load, and
    its blocks hold the stored KV, moved there by the worker."""
    engine = Engine(MODEL, URL, identity("staged"), async_scheduling=True)
    engines.append(engine)
    tokens = prompt(21, 200)
    _stored_and_forgotten(engine, {"first": tokens})
    again = engine.add("again", tokens, max_tokens=3)
    engine.run(lambda: len(again.output_token_ids) >= 1)
    assert not engine.loading and not engine.inline_loads and not engine.load_steps
    blocks = engine.scheduler.kv_cache_manager.get_block_ids("again")[0]
    assert engine.staged_loads == {"again": blocks[:3 * CHUNK // 16]}  # 3 whole chunks
    assert engine.written_correctly("again", len(tokens))
    engine.run(lambda: not engine.scheduler.requests)


def test_two_hits_staged_in_one_step_each_land_in_their_own_blocks(
        engines: list[Engine]) -> None:
    """Two hits whose lookups answer in the same step are both staged in it, so they must
    not share slots: each request's blocks hold its own prompt's KV."""
    engine = Engine(MODEL, URL, identity("staged-two"), async_scheduling=True)
    engines.append(engine)
    prompts = {"a": prompt(22, 200), "b": prompt(23, 136)}
    _stored_and_forgotten(engine, prompts)
    requests = [engine.add(f"{name}-again", tokens, max_tokens=3)
                for name, tokens in prompts.items()]
    engine.step()  # sends both lookups
    time.sleep(0.5)  # both answered by the next step
    engine.run(lambda: all(r.output_token_ids for r in requests))
    assert set(engine.staged_loads) == {"a-again", "b-again"}
    for name, tokens in prompts.items():
        assert engine.written_correctly(f"{name}-again", len(tokens))
    engine.run(lambda: not engine.scheduler.requests)


def test_a_staged_hit_past_vllms_own_prefix_moves_only_the_blocks_vllm_lacks(
        engines: list[Engine]) -> None:
    """vLLM holds a prompt's first six blocks (its own prefix cache, mid-chunk): the stage
    reads from that chunk's start but never writes the blocks vLLM shares, and the worker
    moves only the blocks after them, each from its own slot."""
    engine = Engine(MODEL, URL, identity("staged-partial"), async_scheduling=True,
                    extra={"kvdepot.skip_slow_loads": False})  # load whatever is held
    engines.append(engine)
    tokens = prompt(27, 200)
    _stored_and_forgotten(engine, {"first": tokens})
    prefix = engine.add("prefix", tokens[:100], max_tokens=2)
    engine.run(lambda: len(prefix.output_token_ids) >= 1)
    held = engine.scheduler.kv_cache_manager.get_block_ids("prefix")[0][:6]  # 96 tokens
    engine.run(lambda: not engine.scheduler.requests)
    for tensor in engine.kv.values():  # every block but vLLM's cached ones: zeros
        kept = tensor[:, held].clone()
        tensor.zero_()
        tensor[:, held] = kept
    engine.staged_loads.clear()
    again = engine.add("again", tokens, max_tokens=3)
    engine.run(lambda: len(again.output_token_ids) >= 1)
    blocks = engine.scheduler.kv_cache_manager.get_block_ids("again")[0]
    assert blocks[:6] == held
    assert engine.staged_loads == {"again": blocks[6:3 * CHUNK // 16]}
    assert engine.written_correctly("again", len(tokens))
    engine.run(lambda: not engine.scheduler.requests)


def test_the_staging_area_follows_the_kv_cache_through_its_release_and_restore(
        engines: list[Engine]) -> None:
    """vLLM 0.33's sleep hooks: the area is closed with the KV cache's registration (its
    moves target the tensors being released) and made anew on restore, where a hit is
    staged again into the right blocks."""
    engine = Engine(MODEL, URL, identity("staged-restore"), async_scheduling=True)
    engines.append(engine)
    tokens = prompt(28, 200)
    _stored_and_forgotten(engine, {"first": tokens})
    engine.worker.unregister_kv_caches()
    assert engine.scheduler_connector._scheduler._staging_area() is None
    engine.worker.restore_kv_caches()
    again = engine.add("again", tokens, max_tokens=3)
    engine.run(lambda: len(again.output_token_ids) >= 1)
    assert set(engine.staged_loads) == {"again"} and not engine.loading
    assert engine.written_correctly("again", len(tokens))
    engine.run(lambda: not engine.scheduler.requests)


def test_a_hit_on_a_busy_engine_is_loaded_asynchronously_not_staged(
        engines: list[Engine]) -> None:
    """While another request runs, staging would hold its steps up for the copy: the hit
    loads asynchronously instead, beside them."""
    engine = Engine(MODEL, URL, identity("staged-busy"), async_scheduling=True)
    engines.append(engine)
    tokens = prompt(24, 200)
    _stored_and_forgotten(engine, {"first": tokens})
    # Busy for far longer than the asynchronous copy takes even on a loaded host (its
    # steps run back to back), then ended once the hit is computed.
    busy = engine.add("busy", prompt(25, 40), max_tokens=3000)
    engine.run(lambda: len(busy.output_token_ids) >= 2)
    again = engine.add("again", tokens, max_tokens=3)
    engine.run(lambda: len(again.output_token_ids) >= 1)
    assert not busy.is_finished()
    assert engine.loading == {"again": 3 * CHUNK} and not engine.staged_loads
    assert engine.written_correctly("again", len(tokens))
    engine.scheduler.finish_requests(busy.request_id, RequestStatus.FINISHED_ABORTED)
    engine.run(lambda: not engine.scheduler.requests)


def test_a_hit_whose_staging_fails_is_loaded_asynchronously_and_recomputed(
        engines: list[Engine]) -> None:
    """The server refuses to stage a hit stored in another layout: the load falls back to
    an asynchronous one (refused too), which vLLM recomputes under its asynchronous
    scheduling; the request is never computed on blocks nothing wrote."""
    name = identity("staged-fail")
    writer = Engine(MODEL, URL, name, async_scheduling=True)
    engines.append(writer)
    tokens = prompt(26, 200)
    _stored_and_forgotten(writer, {"stored": tokens})
    reader = Engine(MODEL, URL, name, head_dim=2 * HEAD_DIM, async_scheduling=True)
    engines.append(reader)
    request = reader.add("reader", tokens, max_tokens=3)
    reader.run(lambda: len(request.output_token_ids) >= 1)
    assert reader.loading == {"reader": 3 * CHUNK} and not reader.staged_loads
    assert reader.written_correctly("reader", len(tokens))
    reader.run(lambda: not reader.scheduler.requests)


def test_a_hybrid_models_states_are_stored_and_loaded_with_their_chunks(
        engines: list[Engine]) -> None:
    """A recurrent layer (group 0, its state kept at block boundaries, "align") beside
    attention, as Qwen3-Next: the state after the prompt's last whole chunk, where vLLM
    ends the prefill's first step, is stored with the chunks; after vLLM's cache is
    emptied the prompt loads them and that state into the block vLLM gave it, and the
    stand-in layer, starting from the loaded state as vLLM's workers do, reaches the state
    computing every token gives. Releases whose state handling kvdepot does not follow
    run the model without kvdepot."""
    from kvdepot.integrations.vllm.connector import follows_recurrent_states

    engine = Engine(MODEL, URL, identity("recurrent"), recurrent=True)
    engines.append(engine)
    tokens = prompt(7, 3 * CHUNK + 8)
    first = engine.add("first", tokens, max_tokens=3)
    engine.run(lambda: not engine.scheduler.requests)
    assert first.is_finished()
    assert engine.scheduler.reset_prefix_cache()
    engine.forget_kv()
    again = engine.add("again", tokens, max_tokens=3)
    engine.run(lambda: len(again.output_token_ids) >= 1)
    if not follows_recurrent_states():
        assert not engine.loading and not engine.inline_loads
        assert engine.state_correct("again")  # computed from the start
        return
    assert (engine.loading or engine.inline_loads) == {"again": 3 * CHUNK}
    assert engine.written_correctly("again", 3 * CHUNK)
    assert engine.state_correct("again")
    engine.run(lambda: not engine.scheduler.requests)


def test_preempted_requests_resume_and_finish_with_their_kv_right(
        engines: list[Engine]) -> None:
    """Two requests whose KV outgrows the cache: vLLM preempts one and resumes it later (on
    0.34 as a new request, before as a resumed cached one), looked up and loaded again."""
    engine = Engine(MODEL, URL, identity("preempt"), num_blocks=20)
    engines.append(engine)
    prompts = {"first": prompt(3, 128), "second": prompt(4, 128)}
    # Stored first, so that both lookups below are answered at once from CPU memory and
    # vLLM takes both requests in one step: each then holds 8 of the 19 blocks until it
    # finishes, and either one decoding to 188 tokens (12 blocks) forces a preemption.
    for name, tokens in prompts.items():
        engine.add(f"warm-{name}", tokens, max_tokens=1)
    engine.run(lambda: not engine.scheduler.requests)
    assert engine.scheduler.reset_prefix_cache()
    engine.forget_kv()

    requests = [engine.add(name, tokens, max_tokens=60) for name, tokens in prompts.items()]
    for request in requests:
        engine.run(lambda r=request: len(r.output_token_ids) >= 55, timeout=60)
        assert engine.written_correctly(request.request_id, request.num_computed_tokens)
    assert sum(r.num_preemptions for r in requests) > 0
    engine.run(lambda: not engine.scheduler.requests)
    assert all(r.is_finished() for r in requests)


@pytest.mark.parametrize("groups", [1, 2])
def test_a_failed_load_is_recomputed(engines: list[Engine], groups: int) -> None:
    """An engine whose KV layout differs from the one that stored a prompt hits it, and its
    retrieve is refused (another layout): vLLM must recompute those blocks, with several KV
    cache groups (a sliding window) too, never compute on blocks nothing wrote."""
    name = identity(f"fail-{groups}")
    writer = Engine(MODEL, URL, name, groups=groups)
    engines.append(writer)
    tokens = prompt(5 + groups, 200)
    stored = writer.add("stored", tokens, max_tokens=2)
    writer.run(lambda: not writer.scheduler.requests)
    assert stored.is_finished()

    reader = Engine(MODEL, URL, name, groups=groups, head_dim=2 * HEAD_DIM)
    engines.append(reader)
    request = reader.add("reader", tokens, max_tokens=3)
    reader.run(lambda: len(request.output_token_ids) >= 1)
    # One group: the idle engine loaded it synchronously, and vLLM took this step's
    # load errors; two: asynchronously, its failure reported by request.
    assert ("reader" in reader.inline_loads) == (groups == 1)
    assert reader.written_correctly("reader", len(tokens))
    reader.run(lambda: not reader.scheduler.requests)


def test_kv_events_carry_kvdepots_blocks_in_vllms_media(engines: list[Engine]) -> None:
    """With vLLM's KV events on, the engine's publisher sends kvdepot's blocks beside its
    own: for CPU memory and for the disk tier, in the medium names of this release."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    # vLLM's publisher connects to an address that names a host (it binds wildcards only).
    subscriber.bind(endpoint)
    engine = Engine(MODEL, URL, identity("events"), kv_events_endpoint=endpoint)
    engines.append(engine)
    storage = getattr(vllm_kv_events, "MEDIUM_STORAGE", None) or vllm_kv_events.MEDIUM_FS
    want = {vllm_kv_events.MEDIUM_CPU, storage}
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    stored: list[BlockStored] = []
    request = engine.add("events", prompt(8, 200), max_tokens=2)
    # The hashes vLLM publishes for the request's blocks in its own memory (its GPU
    # medium): those of its whole chunks, three of four blocks each.
    chunked = {maybe_convert_block_hash(h) for h in request.block_hashes[:3 * CHUNK // 16]}

    def complete() -> bool:
        # Each also held by kvdepot in both tiers (the server reports the blocks every
        # engine stored: others come too).
        return all(chunked <= {h for e in stored if e.medium == medium for h in e.block_hashes}
                   for medium in want)

    deadline = time.monotonic() + 30
    try:
        # vLLM collects the connector's events as it steps: step until they are published.
        while not complete():
            assert time.monotonic() < deadline, f"media seen: {sorted({e.medium for e in stored})}"
            engine.step()
            while subscriber.poll(20):
                _topic, _seq, payload = subscriber.recv_multipart()
                stored += [e for e in decoder.decode(payload).events
                           if isinstance(e, BlockStored)]
    finally:
        subscriber.close(linger=0)
    ours = [e for e in stored if e.medium != vllm_kv_events.MEDIUM_GPU]
    assert {e.medium for e in ours} == want
    if "ownership" in BlockStored.__struct_fields__:
        assert {e.ownership for e in ours} == {"kvdepot"}


def _hit_behind_a_full_batch(engines: list[Engine], name: str, running_tokens: int,
                             **options: Any) -> tuple[Engine, Any, Any]:
    """An engine of one running slot (asynchronous scheduling, as on a GPU) whose cache
    holds a prompt vLLM's own cache no longer does; a request decoding `running_tokens`
    takes the slot, then that prompt arrives. (the engine, the running request, the hit)"""
    if not hasattr(KVConnectorBase_V1, "may_load_async"):
        pytest.skip(f"vLLM {RELEASE} has no may_load_async (0.34 added it)")
    engine = Engine(MODEL, URL, identity(name), max_num_seqs=1, async_scheduling=True,
                    **options)
    engines.append(engine)
    tokens = prompt(9, 200)
    engine.add("stored", tokens, max_tokens=1)
    engine.run(lambda: not engine.scheduler.requests)
    assert engine.scheduler.reset_prefix_cache()
    running = engine.add("running", prompt(10, 100), max_tokens=running_tokens)
    engine.run(lambda: len(running.output_token_ids) >= 1)
    return engine, running, engine.add("hit", tokens, max_tokens=2)


def test_with_inflight_loads_a_hit_starts_loading_while_the_batch_is_full(
        engines: list[Engine]) -> None:
    """vLLM 0.34's `--max-num-inflight-kv-loads`: a request the connector says may load
    asynchronously starts its load while the one running slot is taken."""
    # The running request decodes for far longer than the copy takes even on a loaded
    # host (its steps run back to back, a few ms each), then ends when told: the copy's
    # own time is not what is counted here, as a GPU's copy would be done long before the
    # batch's requests finish.
    engine, running, hit = _hit_behind_a_full_batch(
        engines, "inflight", 3000, scheduler_options={"max_num_inflight_kv_loads": 2},
        extra={"kvdepot.staging_mib": 0})
    engine.run(lambda: "hit" in engine.loading)
    assert engine.loading["hit"] == 3 * CHUNK
    engine.run(lambda: "hit" in engine.scheduler.finished_recving_kv_req_ids)
    assert not running.is_finished()  # the batch was full all along
    engine.scheduler.finish_requests(running.request_id, RequestStatus.FINISHED_ABORTED)
    # What it saves: once the slot frees, the loaded request computes its last token in
    # the next step (without the option vLLM would only then look it up, and load it).
    freed_at = len(engine.outputs)
    engine.run(lambda: len(hit.output_token_ids) >= 1)
    assert len(engine.outputs) - freed_at == 1
    engine.run(lambda: not engine.scheduler.requests)


def test_without_inflight_loads_a_hit_waits_for_the_slot_then_for_its_load(
        engines: list[Engine]) -> None:
    """The same without `max_num_inflight_kv_loads`: vLLM asks nothing while the batch
    is full, so the hit's lookup and load start when the slot frees, and its first token
    comes steps later than with the option (engine steps counted, the copy's own time
    aside: on a GPU each step is a forward of the batch). On 0.34, 2026-12-06: 3 steps
    after the slot freed, against 1 with the option. Both without a staging area, which
    would stage the hit once the slot frees (the engine is idle then)."""
    engine, running, hit = _hit_behind_a_full_batch(engines, "no-inflight", 40,
                                                    extra={"kvdepot.staging_mib": 0})
    engine.run(lambda: running.is_finished())
    assert "hit" not in engine.loading and "hit" not in engine.inline_loads
    freed_at = len(engine.outputs)
    engine.run(lambda: len(hit.output_token_ids) >= 1)
    assert engine.loading["hit"] == 3 * CHUNK
    assert len(engine.outputs) - freed_at >= 2
    engine.run(lambda: not engine.scheduler.requests)
