"""The connector's bookkeeping against a scripted client, for paths a real engine rarely takes.

Aborts during a pending lookup, repeated scheduler calls, preemption, roles and
failed retrieves are hard to provoke on demand in a running vLLM; here the
scheduler and worker halves are driven directly with vLLM-shaped inputs.
"""

import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvdepot.client.engine_types import LoadStoreOp
from kvdepot.client.worker import held_blocks, written_blocks
from kvdepot.integrations.vllm.metadata import KVDepotConnectorMetadata, TransferSpec
from kvdepot.integrations.vllm.scheduler_side import SchedulerSide
from kvdepot.integrations.vllm.worker_side import WorkerSide
from kvdepot.protocol import BlockEvent

pytestmark = pytest.mark.vllm

CHUNK, BLOCK = 256, 128


class ScriptedSchedulerClient:
    chunk_size = CHUNK
    boot_id = "one server"
    is_healthy = False  # the block event poller sends nothing to a script

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.results: dict[str, int | None] = {}
        self.prefill_rates: list[float | None] = []

    def _log(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))

    def names(self, name: str) -> list[tuple[Any, ...]]:
        return [args for n, args in self.calls if n == name]

    def maybe_submit_lookup_request(self, request_id: str, token_ids: list[int],
                                    cache_salt: str = "",
                                    prefill_tokens_per_s: float | None = None,
                                    **hashes: Any) -> None:
        self._log("lookup", request_id, len(token_ids), cache_salt)
        self.prefill_rates.append(prefill_tokens_per_s)
        self.lookup_hashes = list(hashes.get("block_hashes", []))
        self.lookup_held = hashes.get("held_blocks", 0)
        self.lookup_tails = hashes.get("tails", False)

    def check_lookup_result(self, request_id: str) -> int | None:
        self._log("check", request_id)
        return self.results.get(request_id, 0)

    def cleanup_lookup_result(self, request_id: str) -> None:
        self._log("cleanup", request_id)

    def release_locks(self, request_id: str, start: int, end: int) -> None:
        self._log("free", request_id, start, end)

    def end_session(self, request_id: str) -> None:
        self._log("end", request_id)

    def report_block_allocations(self, records: list[Any]) -> None:
        self._log("report", len(records))


def request(req_id: str, n: int, preemptions: int = 0, salt: str | None = None) -> Any:
    ids = list(range(10, 10 + n))
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=ids, prompt_is_token_ids=None, all_token_ids=ids,
        num_prompt_tokens=n, cache_salt=salt, num_preemptions=preemptions, lora_request=None,
        mm_features=[],
    )


def blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def step(new: Sequence[tuple[Any, list[int], int, int]] = (),
         cached: Sequence[tuple[str, list[int], int, int]] = (),
         resumed: frozenset[str] = frozenset(), preempted: frozenset[str] = frozenset()) -> Any:
    """A SchedulerOutput: new = (request, block_ids, num_computed, num_scheduled)."""
    scheduled = {r.request_id: n for r, _, _, n in new} | {r: n for r, _, _, n in cached}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(b,),
                                            num_computed_tokens=c) for r, b, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _, _ in cached], resumed_req_ids=set(resumed),
            new_block_ids=[(b,) for _, b, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached]),
        num_scheduled_tokens=scheduled,
        preempted_req_ids=set(preempted),
    )


def scheduler(role: str = "kv_both", **kw: Any) -> tuple[SchedulerSide, ScriptedSchedulerClient]:
    client = ScriptedSchedulerClient()
    side = SchedulerSide(client, block_size=BLOCK, can_load=role != "kv_producer",  # type: ignore[arg-type]
                         can_store=role != "kv_consumer",
                         store_generated=kw.get("store_generated", False),
                         report_block_allocations=False,
                         block_events=kw.get("block_events", False),
                         num_groups=kw.get("num_groups", 1), tails=kw.get("tails", False),
                         inline_loads=kw.get("inline_loads", False),
                         wait_idle_loads=kw.get("wait_idle_loads", False))
    return side, client


def slow_loads(side: SchedulerSide, client: ScriptedSchedulerClient) -> None:
    """Time the engine computing 4 chunks in about 50 ms (a busy step) and a load of 2
    chunks at 300 ms from plan to arrival, so that no load of a few blocks pays (as on
    a GPU)."""
    from vllm.v1.outputs import KVConnectorOutput

    busy = request("busy", 4 * CHUNK)
    side.get_num_new_matched_tokens(busy, 0)
    side.update_state_after_alloc(busy, blocks(list(range(8))), 0)
    side.build_meta(step(new=[(busy, list(range(8)), 0, 4 * CHUNK)]))
    time.sleep(0.05)
    side.build_meta(step(cached=[("busy", [], 4 * CHUNK, 1)]))
    loaded = request("loaded", 2 * CHUNK + 1)
    client.results["loaded"] = 2 * CHUNK
    assert side.get_num_new_matched_tokens(loaded, 0) == (2 * CHUNK, True)
    side.update_state_after_alloc(loaded, blocks(list(range(20, 25))), 2 * CHUNK)
    side.build_meta(step())
    time.sleep(0.3)
    side.update_connector_output(KVConnectorOutput(finished_recving={"loaded"}))


def test_pending_lookup_never_blocks_and_is_sent_once() -> None:
    side, client = scheduler()
    req = request("r", 4 * CHUNK + 10)
    client.results["r"] = None
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(client.names("lookup")) == 1
    client.results["r"] = 3 * CHUNK
    assert side.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, True)
    # vLLM asks again when allocation failed: same answer, nothing counted twice.
    assert side.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, True)
    assert len(client.names("lookup")) == 1


def test_load_starts_at_the_chunk_straddling_the_local_hit() -> None:
    side, client = scheduler()
    req = request("r", 4 * CHUNK + 10)
    client.results["r"] = 4 * CHUNK
    local = 3 * BLOCK  # chunk 0 cached whole, half of chunk 1
    assert side.get_num_new_matched_tokens(req, local) == (4 * CHUNK - local, True)
    block_ids = list(range(100, 109))
    side.update_state_after_alloc(req, blocks(block_ids), 4 * CHUNK - local)
    assert client.names("free") == [("r", 0, CHUNK)]
    assert client.names("cleanup") == [("r",)]
    meta = side.build_meta(step())
    (load,) = meta.loads
    assert (load.start, load.end, load.skip_first_n_tokens) == (CHUNK, 4 * CHUNK, BLOCK)
    assert load.block_ids == [block_ids[2:8]]
    assert meta.stores == []


def test_no_lookup_when_the_local_hit_covers_every_possible_chunk() -> None:
    side, client = scheduler()
    req = request("r", 2 * CHUNK + 1)
    assert side.get_num_new_matched_tokens(req, 2 * CHUNK) == (0, False)
    assert client.names("lookup") == []


def load_plan(n: int, hit: int, local: int, num_blocks: int) -> tuple[Any, Any, Any]:
    """Offer a request of `n` prompt tokens, `hit` of them in kvdepot and `local` in
    vLLM's cache; returns (what vLLM was told, the load, the scripted client)."""
    side, client = scheduler()
    req = request("r", n)
    client.results["r"] = hit
    offer = side.get_num_new_matched_tokens(req, local)
    loads = []
    if offer[0]:
        side.update_state_after_alloc(req, blocks(list(range(100, 100 + num_blocks))),
                                      offer[0])
        loads = side.build_meta(step()).loads
    return offer, loads, client


def test_chunk_aligned_prompt_loads_all_but_its_last_token() -> None:
    offer, (load,), client = load_plan(4 * CHUNK, 4 * CHUNK, 0, 8)
    assert offer == (4 * CHUNK - 1, True)
    assert (load.start, load.end, load.skip_first_n_tokens) == (0, 4 * CHUNK - 1, 0)
    # The last chunk's key needs its every token; its blocks are those vLLM allocated.
    assert len(load.token_ids) == 4 * CHUNK
    assert load.block_ids == [list(range(100, 108))]
    assert client.names("free") == []


def test_local_hit_of_all_but_the_last_block_is_topped_up() -> None:
    local = 4 * CHUNK - BLOCK  # vLLM's own cache stops one block short
    offer, (load,), client = load_plan(4 * CHUNK, 4 * CHUNK, local, 8)
    assert offer == (BLOCK - 1, True)
    assert (load.start, load.end, load.skip_first_n_tokens) == (3 * CHUNK, 4 * CHUNK - 1, BLOCK)
    assert load.block_ids == [[106, 107]]
    assert client.names("free") == [("r", 0, 3 * CHUNK)]


def test_prompt_of_exactly_one_chunk() -> None:
    offer, (load,), _ = load_plan(CHUNK, CHUNK, 0, 2)
    assert offer == (CHUNK - 1, True)
    assert (load.start, load.end) == (0, CHUNK - 1)
    assert load.block_ids == [[100, 101]]


def test_prompt_shorter_than_a_chunk_is_never_looked_up() -> None:
    offer, loads, client = load_plan(CHUNK - 1, 0, 0, 2)
    assert offer == (0, False) and loads == [] and client.names("lookup") == []


def test_prompt_one_token_past_a_chunk_boundary_loads_whole_chunks() -> None:
    offer, (load,), _ = load_plan(2 * CHUNK + 1, 2 * CHUNK, 0, 5)
    assert offer == (2 * CHUNK, True)
    assert (load.start, load.end) == (0, 2 * CHUNK)
    assert len(load.token_ids) == 2 * CHUNK and load.block_ids == [list(range(100, 104))]


def test_hit_of_a_whole_prompt_stores_nothing_more() -> None:
    side, client = scheduler()
    req = request("r", 2 * CHUNK)
    client.results["r"] = 2 * CHUNK
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 2 * CHUNK - 1)
    side.build_meta(step())
    meta = side.build_meta(step(cached=[("r", [], 2 * CHUNK - 1, 1)]))
    assert meta.stores == []


def test_unused_locks_are_freed_when_vllm_loads_nothing() -> None:
    side, client = scheduler()
    req = request("r", 3 * CHUNK)
    client.results["r"] = 2 * CHUNK
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5, 6]), 0)
    assert client.names("free") == [("r", 0, 2 * CHUNK)]
    assert side.build_meta(step()).loads == []


def test_abort_during_lookup_frees_locks_and_ends_the_session() -> None:
    side, client = scheduler()
    req = request("r", 3 * CHUNK + 5)
    client.results["r"] = None
    side.get_num_new_matched_tokens(req, 0)
    assert side.request_finished(req) is False
    assert client.names("free") == [("r", 0, 3 * CHUNK + 5)]
    assert ("r",) in client.names("end") and ("r",) in client.names("cleanup")


def test_stores_cover_full_prompt_chunks_and_delay_the_block_free() -> None:
    side, client = scheduler()
    req = request("r", 3 * CHUNK + 50)
    client.results["r"] = 0
    side.get_num_new_matched_tokens(req, 0)
    ids = list(range(7))
    side.update_state_after_alloc(req, blocks(ids), 0)
    # Chunked prefill: 300 tokens, then the rest.
    meta = side.build_meta(step(new=[(req, ids, 0, 300)]))
    assert [(s.start, s.end, s.block_ids) for s in meta.stores] == [(0, CHUNK, [ids[:2]])]
    meta = side.build_meta(step(cached=[("r", [], 300, 3 * CHUNK + 50 - 300)]))
    assert [(s.start, s.end) for s in meta.stores] == [(CHUNK, 3 * CHUNK)]
    # Decode steps never store generated tokens by default.
    req.all_token_ids.extend(range(CHUNK))
    meta = side.build_meta(step(cached=[("r", [7, 8], 4 * CHUNK - 1, 1)]))
    assert meta.stores == []
    assert side.request_finished(req) is True
    assert side.build_meta(step()).delayed_free_req_ids == ["r"]


def test_with_kv_events_stores_and_lookups_carry_vllms_block_hashes() -> None:
    side, client = scheduler(block_events=True)
    req = request("r", 3 * CHUNK + 50)
    req.block_hashes = [bytes([i]) * 32 for i in range(len(req.all_token_ids) // BLOCK)]
    side.get_num_new_matched_tokens(req, 0)
    assert client.lookup_hashes == req.block_hashes and client.lookup_held == 0
    ids = list(range(7))
    side.update_state_after_alloc(req, blocks(ids), 0)
    meta = side.build_meta(step(new=[(req, ids, 0, 3 * CHUNK + 50)]))
    (store,) = meta.stores
    assert store.block_hashes == b"".join(req.block_hashes[:6]) and store.hash_block_size == BLOCK
    # Hashed finer than our blocks (a hybrid model's hash block size): none are sent.
    finer = request("f", 3 * CHUNK + 50)
    finer.block_hashes = [bytes(32)] * (2 * len(finer.all_token_ids) // BLOCK)
    side.get_num_new_matched_tokens(finer, 0)
    assert client.lookup_hashes == []
    side.update_state_after_alloc(finer, blocks(ids), 0)
    (store,) = side.build_meta(step(new=[(finer, ids, 0, 3 * CHUNK + 50)])).stores
    assert store.block_hashes == b"" and store.hash_block_size == 0
    # Blocks the server reported in CPU memory are named as held (sent no hashes for).
    assert side._block_events is not None
    side._block_events._remember(BlockEvent(True, "CPU", req.block_hashes[:3], None, BLOCK))
    again = request("again", 3 * CHUNK + 50)
    again.block_hashes = req.block_hashes
    side.get_num_new_matched_tokens(again, 0)
    assert client.lookup_held == 3
    # Without KV events, nothing is sent either.
    plain_side, plain_client = scheduler()
    plain_side.get_num_new_matched_tokens(req, 0)
    assert plain_client.lookup_hashes == []


def test_generated_tokens_are_stored_when_enabled() -> None:
    side, _ = scheduler(store_generated=True)
    req = request("r", CHUNK + 10)
    side.get_num_new_matched_tokens(req, 0)
    ids = [0, 1, 2]
    side.update_state_after_alloc(req, blocks(ids), 0)
    assert [s.end for s in side.build_meta(step(new=[(req, ids, 0, CHUNK + 10)])).stores] == [CHUNK]
    req.all_token_ids.extend(range(CHUNK))
    meta = side.build_meta(step(cached=[("r", [3], 2 * CHUNK, 1)]))
    assert [(s.start, s.end) for s in meta.stores] == [(CHUNK, 2 * CHUNK)]


def test_roles_consumer_never_stores_producer_never_looks_up() -> None:
    consumer, _ = scheduler("kv_consumer")
    req = request("r", 2 * CHUNK + 3)
    consumer.get_num_new_matched_tokens(req, 0)
    consumer.update_state_after_alloc(req, blocks([0, 1, 2, 3, 4]), 0)
    assert consumer.build_meta(step(new=[(req, [0, 1, 2, 3, 4], 0, 2 * CHUNK + 3)])).stores == []
    assert consumer.request_finished(req) is False

    producer, client = scheduler("kv_producer")
    assert producer.get_num_new_matched_tokens(req, 0) == (0, False)
    assert client.names("lookup") == []
    producer.update_state_after_alloc(req, blocks([0, 1, 2, 3, 4]), 0)
    meta = producer.build_meta(step(new=[(req, [0, 1, 2, 3, 4], 0, 2 * CHUNK + 3)]))
    assert len(meta.stores) == 1


def test_preempted_request_is_looked_up_again_with_its_new_blocks() -> None:
    side, client = scheduler()
    req = request("r", 2 * CHUNK + 3)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, blocks([0, 1, 2, 3, 4]), 0)
    side.build_meta(step(new=[(req, [0, 1, 2, 3, 4], 0, 2 * CHUNK + 3)]))
    preempted = side.build_meta(step(preempted=frozenset({"r"})))
    assert preempted.preempted_req_ids == ["r"]

    req.num_preemptions = 1
    client.results["r"] = 2 * CHUNK
    assert side.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)
    assert len(client.names("lookup")) == 2
    side.update_state_after_alloc(req, blocks([9, 8, 7, 6, 5]), 2 * CHUNK)
    (load,) = side.build_meta(step()).loads
    assert load.block_ids == [[9, 8, 7, 6]]
    # Stores made before the preemption still hold the blocks at the finish.
    assert side.request_finished(req) is True


def test_cache_salt_travels_with_lookup_and_transfers() -> None:
    side, client = scheduler()
    req = request("r", 2 * CHUNK + 3, salt="tenant")
    side.get_num_new_matched_tokens(req, 0)
    assert client.names("lookup")[0][2] == "tenant"
    side.update_state_after_alloc(req, blocks([0, 1, 2, 3, 4]), 0)
    (store,) = side.build_meta(step(new=[(req, [0, 1, 2, 3, 4], 0, 2 * CHUNK + 3)])).stores
    assert store.cache_salt == "tenant"


class ScriptedWorkerClient:
    def __init__(self) -> None:
        self.stores: list[str] = []
        self.retrieves: list[tuple[str, Any]] = []
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.errors: set[int] = set()
        self.pending_stores: set[str] = set()

    def has_pending_store(self, request_id: str) -> bool:
        return request_id in self.pending_stores

    def batched_submit_store_requests(self, ids: list[str], ops: list[Any], event: Any,
                                      cache_salts: list[str] | None = None) -> None:
        self.stores.extend(ids)

    def batched_submit_retrieve_requests(self, ids: list[str], ops: list[Any], event: Any,
                                         cache_salts: list[str] | None = None) -> None:
        self.retrieves.extend(zip(ids, ops, strict=True))

    def get_finished(self, finished: set[str]) -> tuple[set[str], set[str]]:
        out = self.sending | set(finished), self.recving
        self.sending, self.recving = set(), set()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def get_request_ids_with_load_errors(self) -> set[str]:
        return set()

    def finish_retrieves(self, ids: list[str], timeout: float) -> None:
        # As the client does: each retrieve is resolved, a failed one's blocks become
        # load errors, and none is reported in get_finished.
        self.finished_inline = [*getattr(self, "finished_inline", []), *ids]
        for request_id, op in self.retrieves:
            if request_id in ids and request_id in self.failing:
                self.errors |= set(written_blocks(op, BLOCK))

    failing: frozenset[str] = frozenset()


def test_written_blocks_leave_out_shared_unheld_and_trailing_blocks() -> None:
    # The blocks the worker client reports when a retrieve fails: never one the retrieve
    # does not write (shared with vLLM's prefix cache, let go by a window, past `end`).
    op = LoadStoreOp(token_ids=list(range(4 * CHUNK)), start=CHUNK, end=4 * CHUNK - 1,
                     block_ids=[[10, 11, 12, 13, 14, 15, 98, 99], [-1, -1, -1, 23, 24, 25]],
                     skip_first_n_tokens=BLOCK)
    assert written_blocks(op, BLOCK) == [11, 12, 13, 14, 15, 23, 24, 25]
    assert held_blocks(op.group_block_ids()) == [10, 11, 12, 13, 14, 15, 98, 99, 23, 24, 25]


def test_failed_retrieve_is_reported_for_the_blocks_it_writes_only() -> None:
    # The submit raises: the worker side reports the failure itself, as the client would,
    # and must leave out the block vLLM shares with its prefix cache (10) and the ids past
    # the retrieve's end (98, 99), which other requests may hold.
    client = ScriptedWorkerClient()

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("server gone")

    client.batched_submit_retrieve_requests = refuse  # type: ignore[method-assign]
    worker = WorkerSide(client, block_size=BLOCK, can_load=True, can_store=True,  # type: ignore[arg-type]
                        preemption_wait_s=1.0)
    spec = TransferSpec("r", list(range(4 * CHUNK)), [[10, 11, 12, 13, 14, 15, 98, 99]], CHUNK,
                        4 * CHUNK, skip_first_n_tokens=BLOCK)
    worker.start_loads(KVDepotConnectorMetadata(loads=[spec]))
    assert worker.get_finished(set()) == (set(), {"r"})
    assert worker.get_load_errors() == {11, 12, 13, 14, 15}


def test_client_load_errors_are_passed_on_as_reported() -> None:
    # The client already reports only written blocks; the worker side adds and drops none.
    client = ScriptedWorkerClient()
    worker = WorkerSide(client, block_size=BLOCK, can_load=True, can_store=True,  # type: ignore[arg-type]
                        preemption_wait_s=1.0)
    spec = TransferSpec("r", list(range(4 * CHUNK)), [[10, 11, 12, 13, 14, 15]], CHUNK, 4 * CHUNK,
                        skip_first_n_tokens=BLOCK)
    worker.start_loads(KVDepotConnectorMetadata(loads=[spec]))
    (req_id, op), = client.retrieves
    assert (req_id, op.skip_first_n_tokens) == ("r", BLOCK)
    client.recving, client.errors = {"r"}, set(written_blocks(op, BLOCK))
    assert worker.get_finished(set()) == (set(), {"r"})
    assert worker.get_load_errors() == {11, 12, 13, 14, 15}
    assert worker.get_load_errors() == set()  # reported once


def test_unexpected_external_tokens_become_an_explicit_failed_load() -> None:
    side, client = scheduler()
    req = request("r", 4 * CHUNK + 10)
    client.results["r"] = 4 * CHUNK
    local = 3 * BLOCK
    assert side.get_num_new_matched_tokens(req, local) == (4 * CHUNK - local, True)
    # vLLM asks for two blocks' worth, not what was offered: nothing can be loaded, and
    # the blocks vLLM expects filled (past its own hit of three) must be recomputed.
    side.update_state_after_alloc(req, blocks(list(range(100, 109))), 2 * BLOCK)
    assert client.names("free") == [("r", 0, 4 * CHUNK)]
    meta = side.build_meta(step())
    assert meta.loads == []
    assert meta.failed_loads == {"r": [103, 104]}
    assert len(meta) == 1
    assert side.build_meta(step()).failed_loads == {}  # sent once


@pytest.mark.parametrize("can_load", [True, False])
def test_worker_reports_an_explicit_failed_load_without_a_retrieve(can_load: bool) -> None:
    client = ScriptedWorkerClient()
    worker = WorkerSide(client, block_size=BLOCK, can_load=can_load, can_store=True,  # type: ignore[arg-type]
                        preemption_wait_s=1.0)
    worker.start_loads(KVDepotConnectorMetadata(failed_loads={"r": [103, 104]}))
    assert client.retrieves == []
    # In vLLM's order: finished, failed by request (asked with several groups), blocks.
    assert worker.get_finished(set()) == (set(), {"r"})
    assert worker.get_failed_loads() == {"r"}
    assert worker.get_load_errors() == {103, 104}


def test_only_delayed_requests_are_reported_finished_sending() -> None:
    client = ScriptedWorkerClient()
    worker = WorkerSide(client, block_size=BLOCK, can_load=True, can_store=True,  # type: ignore[arg-type]
                        preemption_wait_s=1.0)
    worker.on_metadata(KVDepotConnectorMetadata(delayed_free_req_ids=["a"]))
    assert worker.get_finished({"a", "b"}) == ({"a"}, set())
    assert worker.get_finished({"a"}) == (set(), set())


def test_preempted_requests_wait_for_their_stores() -> None:
    client = ScriptedWorkerClient()
    worker = WorkerSide(client, block_size=BLOCK, can_load=True, can_store=True,  # type: ignore[arg-type]
                        preemption_wait_s=60.0)
    client.pending_stores = {"p", "other"}
    finisher = threading.Timer(0.1, client.pending_stores.discard, args=("p",))
    finisher.start()
    worker.handle_preemptions(KVDepotConnectorMetadata(preempted_req_ids=["p"]))
    # It returned only once the preempted request's store was done, and did not wait
    # for the store of a request that was not preempted.
    assert client.pending_stores == {"other"}
    finisher.join()


def test_consumer_worker_never_stores() -> None:
    client = ScriptedWorkerClient()
    worker = WorkerSide(client, block_size=BLOCK, can_load=True, can_store=False,  # type: ignore[arg-type]
                        preemption_wait_s=1.0)
    spec = TransferSpec("r", list(range(CHUNK)), [[0, 1]], 0, CHUNK)
    worker.submit_stores(KVDepotConnectorMetadata(stores=[spec]))
    assert client.stores == []


@pytest.mark.parametrize(
    ("use_mla", "rank", "expected"),
    [
        # TP=2 x PP=2; vLLM numbers ranks pp * tp_size + tp.
        (False, 3, (4, 3, True)),
        (True, 0, (2, 0, True)),
        (True, 1, (2, 0, False)),
        (True, 2, (2, 1, True)),
        (True, 3, (2, 1, False)),
    ],
)
def test_mla_drops_tp_from_the_key_space_and_stores_once_per_stage(
    use_mla: bool, rank: int, expected: tuple[int, int, bool]
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvdepot.integrations.vllm.connector import _parallel_strategy, stores_on_this_rank

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=2,
                                        world_size=4, rank=rank),
        model_config=SimpleNamespace(use_mla=use_mla),
    )
    strategy = _parallel_strategy(config, KVConnectorRole.WORKER)  # type: ignore[arg-type]
    got = (strategy.kv_world_size, strategy.kv_worker_id, stores_on_this_rank(strategy))
    assert got == expected


# ---- several KV cache groups (vLLM's hybrid KV cache manager) ---------------------------

def hybrid_scheduler() -> tuple[SchedulerSide, ScriptedSchedulerClient]:
    client = ScriptedSchedulerClient()
    side = SchedulerSide(client, block_size=BLOCK, can_load=True, can_store=True,  # type: ignore[arg-type]
                         store_generated=False, report_block_allocations=False, num_groups=2,
                         frees_blocks_early=True)
    return side, client


def test_hybrid_load_writes_no_block_a_sliding_window_let_go() -> None:
    side, client = hybrid_scheduler()
    req = request("r", 4 * CHUNK)
    client.results["r"] = 4 * CHUNK
    assert side.get_num_new_matched_tokens(req, 0) == (4 * CHUNK - 1, True)
    full, window = list(range(100, 108)), [0] * 6 + [206, 207]  # 0: vLLM's null block
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (full, window)),
                                  4 * CHUNK - 1)
    meta = side.build_meta(SimpleNamespace(
        scheduled_new_reqs=[], num_scheduled_tokens={}, preempted_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[])))
    (load,) = meta.loads
    assert load.block_ids == [full, [-1] * 6 + [206, 207]]
    # The load's blocks are handed out this step: stores reading them must finish first.
    assert meta.reused_block_ids == sorted([*full, 206, 207])


def test_hybrid_store_skips_chunks_whose_window_blocks_are_gone() -> None:
    side, _ = hybrid_scheduler()
    req = request("r", 4 * CHUNK + 10)
    side.get_num_new_matched_tokens(req, 0)
    full, window = list(range(10, 19)), [0, 0, 0, *range(23, 29)]
    meta = side.build_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r", block_ids=(full, window),
                                            num_computed_tokens=0)],
        num_scheduled_tokens={"r": 4 * CHUNK + 10}, preempted_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[])))
    # Chunk 0 (blocks 0-1) and chunk 1 (blocks 2-3: block 2 let go) cannot be stored whole.
    (store,) = meta.stores
    assert (store.start, store.end) == (2 * CHUNK, 4 * CHUNK)
    assert store.block_ids == [full[4:8], window[4:8]]


def test_hybrid_worker_waits_for_stores_reading_reused_blocks_and_fails_by_request() -> None:
    client = ScriptedWorkerClient()
    client.get_request_ids_with_load_errors = lambda: set()  # type: ignore[attr-defined]
    worker = WorkerSide(client, block_size=BLOCK, can_load=True, can_store=True,  # type: ignore[arg-type]
                        preemption_wait_s=60.0, layer_groups={"full.0": 0, "window.0": 1},
                        frees_blocks_early=True)
    worker.submit_stores(KVDepotConnectorMetadata(stores=[
        TransferSpec("a", list(range(CHUNK)), [[1, 2], [3, 4]], 0, CHUNK),
        TransferSpec("b", list(range(CHUNK)), [[5, 6], [7, 8]], 0, CHUNK)]))
    client.pending_stores = {"a", "b"}
    finisher = threading.Timer(0.1, client.pending_stores.discard, args=("a",))
    finisher.start()
    worker.handle_preemptions(KVDepotConnectorMetadata(reused_block_ids=[4, 40]))
    assert client.pending_stores == {"b"}  # waited for "a" only
    finisher.join()
    # A failed load is reported by request; vLLM refuses block ids with several groups.
    worker.start_loads(KVDepotConnectorMetadata(failed_loads={"r": [9, 10, 11]}))
    assert worker.get_finished(set()) == (set(), {"r"})
    assert worker.get_failed_loads() == {"r"}
    assert worker.get_load_errors() == set()


def test_hybrid_failed_load_reported_by_request_is_stored_again() -> None:
    side, client = hybrid_scheduler()
    req = request("r", 3 * CHUNK + 5)
    client.results["r"] = 3 * CHUNK
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, SimpleNamespace(
        get_block_ids=lambda: (list(range(10, 17)), list(range(20, 27)))), 3 * CHUNK)
    side.update_connector_output(SimpleNamespace(invalid_block_ids=set(),
                                                 failed_recving={"r"}))
    # vLLM recomputes the whole prompt; its chunks are stored again.
    meta = side.build_meta(SimpleNamespace(
        scheduled_new_reqs=[], num_scheduled_tokens={"r": 3 * CHUNK + 5},
        preempted_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(req_ids=["r"], resumed_req_ids=set(),
                                              new_block_ids=[None], num_computed_tokens=[0])))
    (store,) = meta.stores
    assert (store.start, store.end) == (0, 3 * CHUNK)


def test_one_sliding_window_group_stores_no_block_it_let_go() -> None:
    # A model whose every layer is sliding-window: one group, freed early all the same.
    client = ScriptedSchedulerClient()
    side = SchedulerSide(client, block_size=BLOCK, can_load=True, can_store=True,  # type: ignore[arg-type]
                         store_generated=False, report_block_allocations=False,
                         frees_blocks_early=True)
    req = request("r", 2 * CHUNK + 10)
    side.get_num_new_matched_tokens(req, 0)
    meta = side.build_meta(step(new=[(req, [0, 11, 12, 13, 14], 0, 2 * CHUNK + 10)]))
    (store,) = meta.stores
    assert (store.start, store.end, store.block_ids) == (CHUNK, 2 * CHUNK, [[12, 13]])
    assert meta.reused_block_ids == [11, 12, 13, 14]


@pytest.mark.parametrize("skip_slow_loads", [True, False])
def test_lookups_carry_the_prefill_rate_measured_from_busy_steps(skip_slow_loads) -> None:
    client = ScriptedSchedulerClient()
    side = SchedulerSide(client, block_size=BLOCK, can_load=True,  # type: ignore[arg-type]
                         can_store=False, store_generated=False,
                         report_block_allocations=False, skip_slow_loads=skip_slow_loads)
    first = request("a", 4 * CHUNK)
    assert side.get_num_new_matched_tokens(first, 0) == (0, False)
    side.update_state_after_alloc(first, blocks(list(range(8))), 0)
    started = time.monotonic()
    side.build_meta(step(new=[(first, list(range(8)), 0, 4 * CHUNK)]))
    time.sleep(0.05)
    side.build_meta(step(cached=[("a", [], 4 * CHUNK, 1)]))  # "a" decodes: a busy gap
    elapsed = time.monotonic() - started
    side.get_num_new_matched_tokens(request("b", 2 * CHUNK), 0)
    first_rate, second_rate = client.prefill_rates
    assert first_rate is None  # nothing measured yet
    if skip_slow_loads:
        assert 4 * CHUNK / elapsed <= second_rate <= 4 * CHUNK / 0.05
    else:
        assert second_rate is None


# ---- tails --------------------------------------------------------------------------------
def test_the_prompts_tail_is_stored_once_with_its_whole_chunks() -> None:
    side, _ = scheduler(tails=True)
    req = request("r", 2 * CHUNK + 200)  # 2 chunks, then a tail of 200 tokens
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, blocks(list(range(6))), 0)
    # The first step computes one chunk: no tail yet.
    first = side.build_meta(step(new=[(req, list(range(6)), 0, CHUNK)]))
    assert [(s.start, s.end, s.tail_tokens) for s in first.stores] == [(0, CHUNK, 0)]
    rest = side.build_meta(step(cached=[("r", [], CHUNK, CHUNK + 200)]))
    (store,) = rest.stores
    assert (store.start, store.end, store.tail_tokens) == (CHUNK, 2 * CHUNK + 200, 200)
    # The tail's second block holds 72 of its tokens: it is stored all the same.
    assert len(store.token_ids) == 2 * CHUNK + 200 and store.block_ids == [[2, 3, 4, 5]]
    # Decoding goes on: the tail is not stored again.
    assert side.build_meta(step(cached=[("r", [], 2 * CHUNK + 200, 1)])).stores == []


def test_a_hit_that_ends_in_a_tail_is_loaded_to_its_end() -> None:
    side, client = scheduler(tails=True)
    req = request("r", 2 * CHUNK + 250)
    client.results["r"] = 2 * CHUNK + 200
    assert side.get_num_new_matched_tokens(req, 0) == (2 * CHUNK + 200, True)
    assert client.lookup_tails is True
    side.update_state_after_alloc(req, blocks(list(range(10, 16))), 2 * CHUNK + 200)
    meta = side.build_meta(step(new=[(req, list(range(10, 16)), 2 * CHUNK + 200, 50)]))
    (load,) = meta.loads
    assert (load.start, load.end, load.tail_tokens) == (0, 2 * CHUNK + 200, 200)
    assert len(load.token_ids) == 2 * CHUNK + 200
    assert load.block_ids == [list(range(10, 16))]
    # The prompt's own tail is longer than the one loaded: it is stored (and supersedes
    # the shorter on the server); the whole chunks are there already.
    (store,) = meta.stores
    assert (store.start, store.end, store.tail_tokens) == (2 * CHUNK, 2 * CHUNK + 250, 250)
    # A prompt that ends where its loaded tail ends stores nothing.
    side, client = scheduler(tails=True)
    req = request("same", 2 * CHUNK + 200)
    client.results["same"] = 2 * CHUNK + 200
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, blocks(list(range(6))), 2 * CHUNK + 199)
    assert side.build_meta(step(new=[(req, list(range(6)), 2 * CHUNK + 199, 1)])).stores == []


def test_a_prompt_that_ends_with_its_tail_loads_all_but_its_last_token() -> None:
    side, client = scheduler(tails=True)
    req = request("r", 2 * CHUNK + BLOCK)
    client.results["r"] = 2 * CHUNK + BLOCK
    assert side.get_num_new_matched_tokens(req, BLOCK) == (2 * CHUNK - 1, True)
    side.update_state_after_alloc(req, blocks(list(range(5))), 2 * CHUNK - 1)
    (load,) = side.build_meta(step()).loads
    assert (load.start, load.end, load.skip_first_n_tokens, load.tail_tokens) == (
        0, 2 * CHUNK + BLOCK - 1, BLOCK, BLOCK)


def test_an_offer_vllm_does_not_take_frees_the_tails_lock_too() -> None:
    side, client = scheduler(tails=True)
    req = request("r", 2 * CHUNK + BLOCK)
    client.results["r"] = 2 * CHUNK + BLOCK
    side.get_num_new_matched_tokens(req, 0)
    # vLLM could only allocate for the whole chunks: it takes all or nothing, so this
    # is the mismatch path, which loads nothing and frees every lock.
    side.update_state_after_alloc(req, blocks(list(range(5))), 2 * CHUNK)
    assert side.build_meta(step()).loads == []
    assert ("r", 0, 2 * CHUNK + BLOCK) in client.names("free")


def test_engines_with_several_kv_cache_groups_keep_whole_chunks_only() -> None:
    side, client = scheduler(tails=True, num_groups=2)
    req = request("r", 2 * CHUNK + 200)
    client.results["r"] = 2 * CHUNK + BLOCK  # a server answering more is not believed
    assert side.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)
    assert client.lookup_tails is False


@pytest.mark.parametrize("skip_slow_loads", [True, False])
def test_a_tail_the_engine_computes_sooner_than_a_load_is_computed(skip_slow_loads) -> None:
    """vLLM holds the prompt's whole chunks; kvdepot holds its tail too. Once a load was
    timed slower than computing the tail, the tail is computed, not waited for."""
    client = ScriptedSchedulerClient()
    side = SchedulerSide(client, block_size=BLOCK, can_load=True,  # type: ignore[arg-type]
                         can_store=False, store_generated=False, tails=True,
                         report_block_allocations=False, skip_slow_loads=skip_slow_loads)
    slow_loads(side, client)
    # vLLM holds 2 chunks of this prompt; kvdepot has its 200-token tail as well.
    tail = request("tail", 2 * CHUNK + 250)
    client.results["tail"] = 2 * CHUNK + 200
    answer = side.get_num_new_matched_tokens(tail, 2 * CHUNK)
    assert answer == ((0, False) if skip_slow_loads else (200, True))
    side.update_state_after_alloc(tail, blocks(list(range(30, 35))), answer[0])
    assert (side.build_meta(step()).loads == []) == skip_slow_loads
    # Not even the most a lookup could find would pay: none is sent (no round trip).
    sent = [args[0] for args in client.names("lookup")]
    assert ("tail" in sent) != skip_slow_loads
    # Once loads are timed far faster than computing, the same tail is looked up and loaded.
    for i in range(40):  # the fit keeps the last 32 loads: all of them fast
        side._load_time.planned(f"fast{i}", 10_000, now=0.0)
        side._load_time.received(f"fast{i}", now=0.0005)
    late = request("late", 2 * CHUNK + 250)
    client.results["late"] = 2 * CHUNK + 200
    assert side.get_num_new_matched_tokens(late, 2 * CHUNK) == (200, True)
    # With nothing held by vLLM, the whole prefix is loaded whatever the timings.
    cold = request("cold", 2 * CHUNK + 250)
    client.results["cold"] = 2 * CHUNK + 200
    assert side.get_num_new_matched_tokens(cold, 0) == (2 * CHUNK + 200, True)


def test_an_idle_engine_loads_synchronously_and_a_busy_one_asynchronously() -> None:
    side, client = scheduler(inline_loads=True)
    first, second, third = (request(r, 3 * CHUNK + 10) for r in ("first", "second", "third"))
    for req in (first, second, third):
        client.results[req.request_id] = 3 * CHUNK
    # Nothing runs: vLLM schedules the request at once and the worker loads it first.
    assert side.get_num_new_matched_tokens(first, 0) == (3 * CHUNK, False)
    side.update_state_after_alloc(first, blocks(list(range(100, 107))), 3 * CHUNK)
    meta = side.build_meta(step(new=[(first, list(range(100, 107)), 3 * CHUNK, 10)]))
    assert [(s.request_id, s.inline) for s in meta.loads] == [("first", True)]
    # `first` runs now: a synchronous load would hold its next step for the copy.
    assert side.get_num_new_matched_tokens(second, 0) == (3 * CHUNK, True)
    side.update_state_after_alloc(second, blocks(list(range(200, 207))), 3 * CHUNK)
    meta = side.build_meta(step(cached=[("first", [], 3 * CHUNK + 10, 1)]))
    assert [(s.request_id, s.inline) for s in meta.loads] == [("second", False)]
    # `first` finishes; `second` only waits for its load: the engine is idle again.
    side.request_finished(first)
    side.build_meta(step())
    assert side.get_num_new_matched_tokens(third, 0) == (3 * CHUNK, False)


def test_a_step_computing_nothing_waits_for_the_pending_asynchronous_loads() -> None:
    """With asynchronous loads (vLLM's asynchronous scheduling), a step that computes
    nothing while a load is pending asks the worker to wait for it within the step; a step
    computing anything, or with no load pending, never does; nor without the option."""
    from vllm.v1.outputs import KVConnectorOutput

    side, client = scheduler(wait_idle_loads=True)
    busy, idle = request("busy", CHUNK + 10), request("idle", 3 * CHUNK + 10)
    client.results["idle"] = 3 * CHUNK
    assert not side.build_meta(step()).wait_for_loads  # nothing pending
    assert side.get_num_new_matched_tokens(idle, 0) == (3 * CHUNK, True)
    side.update_state_after_alloc(idle, blocks(list(range(100, 107))), 3 * CHUNK)
    # `busy` computes in the step that plans the load: the step must not wait for it.
    meta = side.build_meta(step(new=[(busy, [1, 2], 0, CHUNK + 10)]))
    assert [s.request_id for s in meta.loads] == ["idle"] and not meta.wait_for_loads
    # `busy` is done; the load planned a step ago is still pending: this step waits.
    side.request_finished(busy)
    assert side.build_meta(step()).wait_for_loads
    # Reported finished: nothing left to wait for.
    side.update_connector_output(KVConnectorOutput(finished_recving={"idle"}))
    assert not side.build_meta(step()).wait_for_loads
    # An aborted load is not waited for either.
    again = request("again", 3 * CHUNK + 10)
    client.results["again"] = 3 * CHUNK
    assert side.get_num_new_matched_tokens(again, 0) == (3 * CHUNK, True)
    side.update_state_after_alloc(again, blocks(list(range(200, 207))), 3 * CHUNK)
    assert side.build_meta(step()).wait_for_loads
    side.request_finished(again)
    assert not side.build_meta(step()).wait_for_loads

    plain, plain_client = scheduler()
    plain_client.results["idle"] = 3 * CHUNK
    assert plain.get_num_new_matched_tokens(request("idle", 3 * CHUNK + 10), 0)[1] is True
    plain.update_state_after_alloc(request("idle", 3 * CHUNK + 10),
                                   blocks(list(range(100, 107))), 3 * CHUNK)
    assert not plain.build_meta(step()).wait_for_loads


def test_without_inline_loads_or_with_several_groups_every_load_is_asynchronous() -> None:
    for side, _ in (scheduler(), scheduler(inline_loads=True, num_groups=2)):
        req = request("r", 3 * CHUNK + 10)
        side._client.results["r"] = 3 * CHUNK  # type: ignore[attr-defined]
        assert side.get_num_new_matched_tokens(req, 0)[1] is True


@pytest.mark.parametrize("fails", [False, True])
def test_a_synchronous_load_is_finished_before_the_forward_and_never_reported_received(
        fails: bool) -> None:
    client = ScriptedWorkerClient()
    client.failing = frozenset({"sync"} if fails else ())
    worker = WorkerSide(client, block_size=BLOCK, can_load=True, can_store=True,  # type: ignore[arg-type]
                        preemption_wait_s=1.0)
    sync = TransferSpec("sync", list(range(2 * CHUNK)), [[10, 11, 12, 13]], 0, 2 * CHUNK,
                        inline=True)
    later = TransferSpec("later", list(range(2 * CHUNK)), [[20, 21, 22, 23]], 0, 2 * CHUNK)
    worker.start_loads(KVDepotConnectorMetadata(loads=[sync, later]))
    # Only the synchronous one is waited for, before start_load_kv returns.
    assert client.finished_inline == ["sync"]
    assert worker.get_finished(set()) == (set(), set())
    assert worker.get_load_errors() == ({10, 11, 12, 13} if fails else set())


def test_a_synchronous_load_planned_as_failed_is_a_load_error_of_its_step_only() -> None:
    client = ScriptedWorkerClient()
    worker = WorkerSide(client, block_size=BLOCK, can_load=True, can_store=True,  # type: ignore[arg-type]
                        preemption_wait_s=1.0)
    worker.start_loads(KVDepotConnectorMetadata(failed_loads={"r": [103, 104]},
                                                inline_failed_loads=["r"]))
    # The request is in this step's batch: vLLM would not expect it among the received.
    assert worker.get_finished(set()) == (set(), set())
    assert worker.get_load_errors() == {103, 104}
