"""A prompt vLLM serves from its own prefix cache is not stored again, and what the server
says it lacks is.

Driven as `test_connector_logic` drives the scheduler side, with requests carrying block
hashes chained the way vLLM chains them (salt first, then each block's tokens).
"""

import hashlib
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput

from kvdepot.integrations.vllm.scheduler_side import SchedulerSide
from tests.e2e.test_connector_logic import (
    BLOCK,
    CHUNK,
    ScriptedSchedulerClient,
    blocks,
    request,
    scheduler,
    slow_loads,
    step,
)

pytestmark = pytest.mark.vllm


def hashed(req_id: str, n: int, salt: str | None = None) -> Any:
    """A request of `n` prompt tokens with vLLM-like hashes of its full blocks."""
    req = request(req_id, n, salt=salt)
    chain, hashes = (salt or "").encode(), []
    for b in range(n // BLOCK):
        chain = hashlib.sha256(chain + repr(req.all_token_ids[b * BLOCK:(b + 1) * BLOCK])
                               .encode()).digest()
        hashes.append(chain)
    req.block_hashes = hashes
    return req


def block_ids(req: Any) -> list[int]:
    return list(range(100, 100 + -(-req.num_prompt_tokens // BLOCK)))


def stores(meta: Any) -> list[tuple[int, int, int]]:
    return [(s.start, s.end, s.tail_tokens) for s in meta.stores]


def computed_whole(side: SchedulerSide, client: ScriptedSchedulerClient, req: Any,
                   held: int = 0) -> list[tuple[int, int, int]]:
    """vLLM computes `req` from its first token (the server answering `held`); the stores
    planned for it."""
    client.results[req.request_id] = held
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, blocks(block_ids(req)), 0)
    planned = stores(side.build_meta(step(new=[(req, block_ids(req), 0, req.num_prompt_tokens)])))
    side.request_finished(req)
    return planned


def own_hit(side: SchedulerSide, req: Any, local: int
            ) -> tuple[tuple[int | None, bool], list[tuple[int, int, int]], bool]:
    """vLLM serves `local` tokens of `req` from its own prefix cache and computes the rest:
    what kvdepot offered vLLM, the stores planned, and whether the blocks wait for them."""
    offer = side.get_num_new_matched_tokens(req, local)
    side.update_state_after_alloc(req, blocks(block_ids(req)), offer[0] or 0)
    planned = stores(side.build_meta(step(
        new=[(req, block_ids(req), local, req.num_prompt_tokens - local)])))
    return offer, planned, side.request_finished(req)


def test_a_prompt_vllm_holds_whole_is_not_stored_again() -> None:
    side, client = scheduler()
    assert computed_whole(side, client, hashed("cold", 3 * CHUNK + 50)) == [(0, 3 * CHUNK, 0)]
    # vLLM holds every whole chunk: no lookup could find more, so none is sent, and the
    # chunks its blocks hold went to the server when it computed them.
    offer, planned, blocks_wait = own_hit(side, hashed("again", 3 * CHUNK + 50), 3 * CHUNK)
    assert offer == (0, False) and client.names("lookup") == [("cold", 3 * CHUNK + 50, "")]
    assert planned == [] and blocks_wait is False
    assert client.names("end") == [("cold",)]  # the own hit never talked to the server
    # Another scope (cache salt) names other pieces: stored whatever this one holds.
    assert own_hit(side, hashed("salted", 3 * CHUNK + 50, salt="s"), 3 * CHUNK)[1] == [
        (0, 3 * CHUNK, 0)]


def test_on_an_engine_computing_faster_than_it_loads_an_own_hit_sends_nothing() -> None:
    """The GPU case: vLLM holds all but the last block, which it computes sooner than a
    load would bring it. The chunk it ends in, or the prompt's tail, was stored when the
    prompt was first computed: nothing goes to the server."""
    side, client = scheduler(tails=True)
    slow_loads(side, client)
    aligned, tailed = hashed("aligned", 4 * CHUNK), hashed("tailed", 3 * CHUNK + 50)
    assert computed_whole(side, client, aligned) == [(0, 4 * CHUNK, 0)]
    assert computed_whole(side, client, tailed) == [(0, 3 * CHUNK + 50, 50)]
    client.calls.clear()
    for req, local in ((hashed("a2", 4 * CHUNK), 4 * CHUNK - BLOCK),
                       (hashed("t2", 3 * CHUNK + 50), 3 * CHUNK)):
        assert own_hit(side, req, local) == ((0, False), [], False)
    assert client.calls == []
    # A prompt that goes on past the tail has a tail of its own, which is stored.
    longer = hashed("longer", 3 * CHUNK + 90)
    assert own_hit(side, longer, 3 * CHUNK)[1] == [(3 * CHUNK, 3 * CHUNK + 90, 90)]


def test_pieces_a_lookup_finds_missing_are_stored_again() -> None:
    side, client = scheduler()
    assert computed_whole(side, client, hashed("cold", 3 * CHUNK + 1)) == [(0, 3 * CHUNK, 0)]
    # The server has since lost the last two chunks: vLLM holds two, so a lookup is sent
    # for the third, and its answer (one chunk) says what to store again.
    again = hashed("again", 3 * CHUNK + 1)
    client.results["again"] = CHUNK
    offer, planned, blocks_wait = own_hit(side, again, 2 * CHUNK)
    assert offer == (0, False) and planned == [(CHUNK, 3 * CHUNK, 0)] and blocks_wait
    # Then offered again: the next own hit sends nothing.
    assert own_hit(side, hashed("third", 3 * CHUNK + 1), 3 * CHUNK)[1] == []


def test_a_new_server_process_is_sent_everything_again() -> None:
    side, client = scheduler()
    computed_whole(side, client, hashed("cold", 3 * CHUNK + 1))
    client.boot_id = "a restarted server"
    assert own_hit(side, hashed("again", 3 * CHUNK + 1), 3 * CHUNK)[1] == [(0, 3 * CHUNK, 0)]


def test_chunks_of_a_failed_load_are_stored_again() -> None:
    side, client = scheduler()
    computed_whole(side, client, hashed("cold", 3 * CHUNK + 1))
    req = hashed("r", 3 * CHUNK + 1)
    client.results["r"] = 3 * CHUNK  # found, so recorded as held
    assert side.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, True)
    side.update_state_after_alloc(req, blocks(block_ids(req)), 3 * CHUNK)
    (load,) = side.build_meta(step()).loads
    # The retrieve fails (the server lost them meanwhile): vLLM recomputes the prompt.
    side.update_connector_output(KVConnectorOutput(invalid_block_ids={load.block_ids[0][0]}))
    meta = side.build_meta(step(cached=[("r", [], 0, 3 * CHUNK + 1)]))
    assert stores(meta) == [(0, 3 * CHUNK, 0)]


def test_the_record_forgets_its_oldest_names_first() -> None:
    from kvdepot.integrations.vllm.offered_chunks import OfferedChunks

    offered = OfferedChunks(capacity=3).of_server("one")
    offered.add(["a", "b", "c"])
    offered.add(["a", "d"])  # "a" is named again: "b" is now the oldest
    assert [name in offered for name in "abcd"] == [True, False, True, True]
    offered.discard(["c", "never named"])
    assert len(offered) == 2
    assert len(offered.of_server("one")) == 2 and len(offered.of_server("two")) == 0
