"""Recurrent states of hybrid models (Qwen3-Next: Gated DeltaNet beside attention), through
a real server and engine processes: a state is kept beside the chunk it ends
(`Store.with_state`), and a lookup with `states` ends its hit at the last held chunk
whose state is held too.

The engines have two KV cache groups: group 0 is attention (2 layers, 4 blocks of 16
tokens per 64-token chunk), group 1 two recurrent layers of 256-byte states, one per
block (`tests/support/engine.py`, `state_groups`). Bytes are compared block by block.
"""

import pytest
import torch

from kvdepot.client.admin import AdminClient
from kvdepot.client.kv_export import GROUP_HINT, STATE_HINT
from tests.support.engine import EngineError
from tests.support.waiting import wait_until

CHUNK = 64  # the server fixture's chunk size; 16-token blocks: 4 per chunk
PER_CHUNK = 4
BLOCKS = 32  # the engines' blocks (of each group)
TOKENS = list(range(3000, 3000 + 3 * CHUNK))
PROMPT = [*TOKENS, 7]  # a prompt going on past the stored chunks
HYBRID = {"groups": 2, "state_groups": (1,)}
STATE = (1,)  # the state group: an op carrying the state names it


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def everything(engine) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every block of every layer: attention, then states."""
    return engine.read_blocks(list(range(BLOCKS))), engine.read_states(list(range(BLOCKS)))


def attention(chunks: range) -> list[int]:
    return [b for c in chunks for b in range(c * PER_CHUNK, (c + 1) * PER_CHUNK)]


def stats(server) -> dict:
    with AdminClient(server.url) as admin:
        return admin.stats()


def test_chunks_and_their_states_round_trip_and_nothing_else_is_written(engines, server):
    writer, reader = engines(**HYBRID), engines(**HYBRID)
    writer.fill(seed=31)
    # Two stores, each ending at its state: chunks 0-1 with the state after chunk 1 (in
    # state block 20), then chunk 2 with the state after it (block 21).
    writer.store("w1", TOKENS, [attention(range(2)), [20]], 0, 2 * CHUNK, state_groups=STATE)
    writer.store("w2", TOKENS, [attention(range(2, 3)), [21]], 2 * CHUNK, 3 * CHUNK,
                 state_groups=STATE)
    assert writer.last_errors() == []
    reader.fill(seed=32)
    before_blocks, before_states = everything(reader)
    assert reader.lookup("r", PROMPT, states=True) == 3 * CHUNK
    assert stats(server)["locked_chunks"] == 4  # three chunks and the state after them
    dst, dst_state = [31, 5, 17, 2, 9, 30, 12, 0, 23, 14, 6, 27], 3
    assert reader.retrieve("r", PROMPT, [dst, [dst_state]], 0, 3 * CHUNK,
                           state_groups=STATE) == set()
    assert reader.last_errors() == []
    assert same(writer.read_blocks(attention(range(3))), reader.read_blocks(dst))
    assert same(writer.read_states([21]), reader.read_states([dst_state]))
    # The state after chunk 1 is another piece, found by the prompt that ends there; the
    # engine's own prefix cache holding chunk 0, only chunk 1 and the state are written.
    assert reader.lookup("r2", PROMPT[:2 * CHUNK + 5], states=True) == 2 * CHUNK
    dst2 = [1, 3, 4, 8, 10, 11, 13, 15]
    assert reader.retrieve("r2", PROMPT, [dst2, [7]], 0, 2 * CHUNK, skip=CHUNK,
                           state_groups=STATE) == set()
    assert same(writer.read_blocks(attention(range(1, 2))), reader.read_blocks(dst2[4:]))
    assert same(writer.read_states([20]), reader.read_states([7]))
    after_blocks, after_states = everything(reader)
    for b in range(BLOCKS):
        if b not in dst + dst2[4:]:
            assert same([t[b] for t in after_blocks], [t[b] for t in before_blocks]), b
        if b not in (dst_state, 7):
            assert same([t[b] for t in after_states], [t[b] for t in before_states]), b
    s = stats(server)
    assert s["stored_chunks"] == 3 and s["stored_states"] == 2
    assert s["retrieved_chunks"] == 5 and s["retrieved_states"] == 2
    assert s["retrieved_tokens"] == 3 * CHUNK + CHUNK
    assert s["hit_states"] == 2 and s["hits_cut_to_state"] == 0
    assert s["locked_chunks"] == 0  # the retrieves read every lock the lookups took


def test_a_hit_ends_at_the_last_held_state_and_keeps_no_lock_past_it(engines, server):
    writer, reader = engines(**HYBRID), engines(**HYBRID)
    writer.fill(seed=33)
    writer.store("w1", TOKENS, [attention(range(1)), [10]], 0, CHUNK, state_groups=STATE)
    writer.store("w2", TOKENS, [attention(range(1, 3)), []], CHUNK, 3 * CHUNK)
    assert reader.lookup("r", PROMPT, states=True) == CHUNK
    s = stats(server)
    assert s["hits_cut_to_state"] == 1 and s["hit_states"] == 1 and s["hit_chunks"] == 1
    assert s["locked_chunks"] == 2  # chunk 0 and its state; chunks 1 and 2 given back
    # The range the hit covers gives the chunk and the state after it back.
    reader.release_locks("r", 0, CHUNK)
    wait_until(lambda: stats(server)["locked_chunks"] == 0, "the chunk's and state's release")
    # Without the state the chunk is no hit: nothing stays locked after it either.
    other = [t + 50_000 for t in PROMPT]
    writer.store("w3", other, [attention(range(3)), []], 0, 3 * CHUNK)
    assert reader.lookup("none", other, states=True) == 0
    assert stats(server)["locked_chunks"] == 0
    # A load past the held state is refused whole: the chunks are held, their state not.
    reader.write_through_old_view(0.0)
    assert reader.retrieve("past", PROMPT, [attention(range(4, 6)), [3]], 0, 2 * CHUNK,
                           state_groups=STATE) == {*attention(range(4, 6)), 3}
    assert "the recurrent state after token 128" in reader.last_errors()[0]
    blocks, states = everything(reader)
    assert all(bool((t == 0).all()) for t in [*blocks, *states])
    # Ending the session releases a hit's state as well.
    assert reader.lookup("ended", PROMPT, states=True) == CHUNK
    assert stats(server)["locked_chunks"] == 2
    reader.call("scheduler", "end_session", "ended")
    wait_until(lambda: stats(server)["locked_chunks"] == 0, "the session's release")
    # A lookup without `states` (an engine without recurrent layers) hears of every
    # chunk, held state or not.
    assert reader.lookup("plain", PROMPT) == 3 * CHUNK
    assert reader.lookup("plain2", other) == 3 * CHUNK
    s = stats(server)
    assert s["stored_chunks"] == 6 and s["stored_states"] == 1
    assert s["hits_cut_to_state"] == 3 and s["hit_states"] == 2


def test_states_on_every_tp_rank_or_no_hit(engines, server):
    """A state counts only when every rank stored it: rank 1 storing its chunks but not
    its state is no hit for either rank."""
    rank0 = engines(world_size=2, rank=0, **HYBRID)
    rank1 = engines(world_size=2, rank=1, **HYBRID)
    rank0.fill(seed=34)
    rank1.fill(seed=35)
    rank0.store("w", TOKENS, [attention(range(2)), [4]], 0, 2 * CHUNK, state_groups=STATE)
    rank1.store("w", TOKENS, [attention(range(2)), []], 0, 2 * CHUNK)
    assert rank0.lookup("r", PROMPT, states=True) == 0
    assert stats(server)["locked_chunks"] == 0
    rank1.store("w2", TOKENS, [attention(range(1, 2)), [6]], CHUNK, 2 * CHUNK,
                state_groups=STATE)
    assert rank0.lookup("r2", PROMPT, states=True) == 2 * CHUNK
    for engine, state in ((rank0, 4), (rank1, 6)):
        assert engine.retrieve("r2", PROMPT, [attention(range(4, 6)), [30]], 0, 2 * CHUNK,
                               state_groups=STATE) == set()
        assert same(engine.read_states([state]), engine.read_states([30]))
        assert same(engine.read_blocks(attention(range(2))),
                    engine.read_blocks(attention(range(4, 6))))
    assert stats(server)["locked_chunks"] == 0


def test_a_state_group_numbered_before_the_attention_group(engines):
    """vLLM numbers the groups as the model's layers come: the recurrent one may be 0."""
    engine = engines(groups=2, state_groups=(0,))
    engine.fill(seed=39)
    engine.store("w1", TOKENS, [[5], attention(range(2))], 0, 2 * CHUNK, state_groups=(0,))
    engine.store("w2", TOKENS, [[], attention(range(2, 3))], 2 * CHUNK, 3 * CHUNK)
    assert engine.last_errors() == []
    assert engine.lookup("r", PROMPT, states=True) == 2 * CHUNK
    assert engine.retrieve("r", PROMPT, [[9], attention(range(4, 6))], 0, 2 * CHUNK,
                           state_groups=(0,)) == set()
    assert same(engine.read_states([5]), engine.read_states([9]))
    assert same(engine.read_blocks(attention(range(2))),
                engine.read_blocks(attention(range(4, 6))))


# (name, block lists, start, end, state groups, what the server says)
_BAD_STORES = [
    ("two_state_blocks", [attention(range(1)), [8, 9]], 0, CHUNK, STATE,
     "must be the one block holding the state, not 2 ids"),
    ("no_state_block", [attention(range(1)), []], 0, CHUNK, STATE,
     "must be the one block holding the state, not 0 ids"),
    ("a_block_without_state", [attention(range(1)), [8]], 0, CHUNK, (),
     "must be empty when no state is carried, not 1 ids"),
    ("end_inside_a_chunk", [attention(range(2)), [8]], 0, CHUNK + 16, STATE,
     "carried only by a range of whole chunks"),
    ("empty_range", [[], [8]], CHUNK, CHUNK, STATE, "carried only by a range of whole chunks"),
    ("state_block_out_of_range", [attention(range(1)), [BLOCKS]], 0, CHUNK, STATE,
     "block id 32 is outside the registered KV cache"),
]


def test_bad_state_transfers_are_refused_clearly_and_move_nothing(engines, server):
    plain, engine = engines(), engines(**HYBRID)
    engine.fill(seed=36)
    plain.fill(seed=37)
    # Stores: each is refused with the server's reason, and nothing is held after it.
    plain.store("bad", TOKENS, attention(range(1)), 0, CHUNK, state_groups=STATE)
    assert len(plain.last_errors()) == 1
    assert "registered no recurrent-state layers" in plain.last_errors()[0]
    for name, lists, start, end, groups, message in _BAD_STORES:
        engine.store(name, TOKENS, lists, start, end, state_groups=groups)
        assert len(engine.last_errors()) == 1 and message in engine.last_errors()[0], name
    s = stats(server)
    assert s["chunks"] == 0 and s["stored_chunks"] == 0 and s["stored_states"] == 0
    assert s["store_errors"] == 1 + len(_BAD_STORES)
    # Retrieves of chunks and a state that are held: a bad one writes no block, and
    # every block it names is reported for recomputing.
    engine.store("w", TOKENS, [attention(range(2)), [8]], 0, 2 * CHUNK, state_groups=STATE)
    assert engine.last_errors() == []
    engine.write_through_old_view(0.0)
    for name, lists, start, end, groups, message in _BAD_STORES:
        if start == end:
            continue  # nothing to retrieve
        lists = [[b + 16 for b in lists[0]], lists[1]]
        errors = engine.retrieve(f"r-{name}", PROMPT, lists, start, end, state_groups=groups)
        assert len(engine.last_errors()) == 1 and message in engine.last_errors()[0], name
        assert errors == {*lists[0][:-(-end // 16)], *lists[1]}, name
    blocks, states = everything(engine)
    assert all(bool((t == 0).all()) for t in [*blocks, *states])
    # A plain engine naming a state in a retrieve is refused the same way.
    assert plain.lookup("p", PROMPT) == 2 * CHUNK  # same model, same keys
    assert plain.retrieve("p", PROMPT, attention(range(4, 6)), 0, 2 * CHUNK,
                          state_groups=STATE) == set(attention(range(4, 6)))
    assert "registered no recurrent-state layers" in plain.last_errors()[0]
    assert stats(server)["retrieved_chunks"] == 0


@pytest.mark.parametrize("case", ["only_states", "mixed_group", "short_hint"])
def test_registrations_that_cannot_hold_states_are_refused(engines, case):
    states = [False, False, True, True]  # group 0: two attention layers; group 1: states
    kwargs, message = {
        "only_states": ({"groups": 1, "state_groups": (0,)},
                        "only recurrent-state layers were registered"),
        "mixed_group": ({**HYBRID, "layout_hints": {GROUP_HINT: [0, 0, 1, 1],
                                                    STATE_HINT: [True, *states[1:]]}},
                        "KV cache group 0 mixes recurrent-state layers with attention"),
        "short_hint": ({**HYBRID, "layout_hints": {GROUP_HINT: [0, 0, 1, 1],
                                                   STATE_HINT: states[:3]}},
                       "has 3 entries for 4 KV cache layers"),
    }[case]
    with pytest.raises(Exception, match=message):
        engines(**kwargs)


@pytest.mark.parametrize("reader_kwargs", [
    {},  # no state group: one attention group
    {"groups": 2},  # two attention groups, no state group
    {**HYBRID, "state_bytes": 128},  # states of another size
], ids=["one_group", "no_state_group", "other_state_size"])
def test_another_architecture_under_the_same_model_loads_no_bytes(engines, reader_kwargs):
    writer, reader = engines(**HYBRID), engines(**reader_kwargs)
    writer.fill(seed=38)
    writer.store("w", TOKENS, [attention(range(2)), [8]], 0, 2 * CHUNK, state_groups=STATE)
    hybrid = "state_groups" in reader_kwargs
    groups = reader_kwargs.get("groups", 1)
    reader.write_through_old_view(0.0)
    dst = attention(range(4, 6))
    lists = ([dst, [9]] if hybrid else [dst, dst] if groups == 2 else dst)
    # The keys are the model's: the hit is found, the load refused.
    assert reader.lookup("r", PROMPT, states=hybrid) == 2 * CHUNK
    errors = reader.retrieve("r", PROMPT, lists, 0, 2 * CHUNK,
                             state_groups=STATE if hybrid else ())
    assert errors == ({*dst, 9} if hybrid else set(dst))
    assert "different KV cache layout" in reader.last_errors()[0]
    blocks, states = everything(reader)
    assert all(bool((t == 0).all()) for t in [*blocks, *states])


def test_a_lookup_for_tails_and_states_at_once_is_refused(engines, server):
    engine = engines(**HYBRID)
    engine.fill(seed=5)
    engine.store("s", TOKENS, [attention(range(1)), [1]], 0, CHUNK, state_groups=STATE)
    before = stats(server)
    # The server's InvalidRequest, as the engine process passes it on.
    with pytest.raises(EngineError, match="tails or for recurrent states, not both"):
        engine.lookup("both", PROMPT, tails=True, states=True)
    after = stats(server)
    assert after["locked_chunks"] == 0 and after["lookups"] == before["lookups"]
    assert engine.lookup("states", PROMPT, states=True) == CHUNK
