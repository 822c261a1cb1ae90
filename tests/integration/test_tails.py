"""Tails: a prompt's tokens past its last whole chunk, stored, found and loaded.

Real server processes and engine processes; bytes compared block by block. The server
fixture's chunk is 64 tokens, the engines' blocks 16: a tail of 40 tokens is held in 3
blocks, the last one partly.
"""

import pytest
import torch

from kvdepot.client.admin import AdminClient
from kvdepot.errors import InvalidRequest
from kvdepot.keys import tail_tokens
from kvdepot.protocol import RequestType, Store, pack_ints
from kvdepot.rpc.connection import DepotConnection
from kvdepot.storage.shared import value
from tests.support.raw_registration import FENCE, register
from tests.support.server import small_server
from tests.support.waiting import wait_for_writes, wait_until

CHUNK = 64
BLOCK = 16
DOC = list(range(5000, 5000 + 2 * CHUNK + 40))  # two whole chunks, then 40 tokens
TAIL = 40
STORED = 2 * CHUNK + TAIL


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def store_doc(engine, tokens=DOC, first_block: int = 0) -> list[int]:
    """Store the two whole chunks and the tail of `tokens`; returns the blocks used."""
    blocks = list(range(first_block, first_block + -(-STORED // BLOCK)))
    engine.store("w", tokens, blocks, 0, STORED, tail=TAIL)
    return blocks


def test_a_tail_is_a_byte_exact_hit_and_only_its_blocks_are_written(engines, server):
    writer, reader = engines(num_blocks=32), engines(num_blocks=32)
    writer.fill(seed=5)
    src = store_doc(writer)
    # The prompt goes on past the tail: the hit ends at the tail's last block.
    prompt = [*DOC, 1, 2, 3]
    assert reader.lookup("r", prompt, tails=True) == STORED
    # An engine that loads no tails hears of whole chunks only.
    assert reader.lookup("r-chunks", prompt) == 2 * CHUNK
    dst = list(range(31, 31 - -(-STORED // BLOCK), -1))
    assert reader.retrieve("r", prompt, dst, 0, STORED, tail=TAIL) == set()
    assert same(writer.read_blocks(src), reader.read_blocks(dst))
    untouched = [b for b in range(32) if b not in dst]
    assert all(bool((t == 0).all()) for t in reader.read_blocks(untouched))
    with AdminClient(server.url) as admin:
        stats = admin.stats()
    assert stats["stored_chunks"] == 2 and stats["stored_tails"] == 1
    assert stats["retrieved_chunks"] == 2 and stats["retrieved_tails"] == 1
    assert stats["hit_tails"] == 1 and stats["hit_tail_tokens"] == TAIL
    # The tail takes three blocks of the four a chunk has: 3 of the 11 blocks held.
    assert stats["tail_bytes"] * 11 == stats["used_bytes"] * 3


def test_another_tail_of_the_same_length_or_another_prefix_does_not_hit(engines):
    writer, reader = engines(), engines()
    writer.fill(seed=6)
    store_doc(writer)
    other_tail = [*DOC[:2 * CHUNK], *(t + 1 for t in DOC[2 * CHUNK:])]
    assert reader.lookup("tail", other_tail, tails=True) == 2 * CHUNK
    # The same tail tokens after another prefix: its chain differs, nothing hits.
    other_prefix = [*DOC[:CHUNK], *(t + 7 for t in DOC[CHUNK:2 * CHUNK]), *DOC[2 * CHUNK:]]
    assert reader.lookup("prefix", other_prefix, tails=True) == CHUNK
    # A prompt whose tail is shorter: the stored tail covers it, but names tokens this
    # prompt lacks, so nothing past the whole chunks hits.
    assert reader.lookup("short", DOC[:2 * CHUNK + 20], tails=True) == 2 * CHUNK


def test_the_tail_of_a_prompt_shorter_than_a_chunk(engines):
    writer, reader = engines(), engines()
    writer.fill(seed=7)
    system = DOC[:48]
    writer.store("w", system, [0, 1, 2], 0, 48, tail=48)
    assert reader.lookup("r", [*system, 9], tails=True) == 48
    assert reader.retrieve("r", [*system, 9], [7, 8, 9], 0, 48, tail=48) == set()
    assert same(writer.read_blocks([0, 1, 2]), reader.read_blocks([7, 8, 9]))


def test_a_chat_turn_loads_the_tail_the_previous_turn_stored(engines):
    """Turn 2's prompt runs on through the chunk where turn 1's tail lies: its whole
    chunks before it hit, then turn 1's tail, and the engine computes the rest."""
    engine = engines(num_blocks=32)
    engine.fill(seed=8)
    store_doc(engine)
    turn2 = [*DOC, *range(100, 100 + CHUNK)]  # chunk 2 is now whole, and differs
    assert engine.lookup("turn2", turn2, tails=True) == STORED
    # The load may end inside the tail (vLLM computes a prompt's last token); a skip
    # leaves blocks shared with the engine's own prefix cache alone.
    tail_blocks = engine.read_blocks([9, 10])  # the tail's second and third blocks
    engine.write_through_old_view(0.0)
    assert engine.retrieve("turn2", turn2, [20, 21, 22], 2 * CHUNK, STORED - 1, skip=BLOCK,
                           tail=TAIL) == set()
    assert engine.blocks_hold([20], 0.0) and same(tail_blocks, engine.read_blocks([21, 22]))


def test_the_whole_chunk_supersedes_its_tail(engines, server):
    engine = engines(num_blocks=32)
    engine.fill(seed=9)
    store_doc(engine)
    longer = [*DOC, *range(100, 100 + CHUNK)]
    engine.store("w2", longer, list(range(12)), 0, 3 * CHUNK)
    # Lookups of the longer prompt go past the tail's chunk ...
    assert engine.lookup("r", longer, tails=True) == 3 * CHUNK
    # ... the tail still serves the prompt that ends in it while memory allows ...
    assert engine.lookup("r2", [*DOC, 1], tails=True) == STORED
    with AdminClient(server.url) as admin:
        assert admin.stats()["tail_bytes"] > 0


def test_a_tail_its_whole_chunk_superseded_is_the_first_to_go(engines, engines_at, server):
    """Room for exactly what is stored, then one more tail: the tail a whole chunk
    superseded makes room for it, not the older tail of another prompt (the least recently
    used tail). Tails of one size, so that either would free a fitting extent."""
    probe = engines()
    probe.fill(seed=14)
    probe.store("probe", DOC, [0, 1, 2, 3], 0, CHUNK)
    chunk = int(server.stats()["used_bytes"])  # one chunk; a 40-token tail is 3/4 of one
    small = small_server(chunk_size=CHUNK, l1_size=chunk * 9 // 2).start()
    try:
        engine = engines_at(small.url, num_blocks=64)
        engine.fill(seed=15)
        other = [t + 70_000 for t in DOC[:TAIL]]
        engine.store("b", other, [0, 1, 2], 0, TAIL, tail=TAIL)  # the older tail
        store_doc(engine, first_block=3)  # 2 chunks and tail A: 3.5 chunks' bytes held
        longer = [*DOC, *range(100, 124)]  # chunk 2 whole: it holds tail A's tokens
        engine.store("w2", longer, list(range(20, 32)), 0, 3 * CHUNK)
        assert small.stats()["evictions"] == 0  # 4.5 chunks held: memory is full
        newest = [t + 90_000 for t in DOC[:TAIL]]
        engine.store("x", newest, [40, 41, 42], 0, TAIL, tail=TAIL)
        stats = small.stats()
        assert stats["evictions"] == 1 and stats["tail_bytes"] * 2 == chunk * 3
        # Each hit's locks are given back before the next lookup: together they would pass
        # the tenant's bound on locked memory in so small a cache.
        for name, prompt, hit in (("x", newest, TAIL), ("b", other, TAIL),
                                  ("a", DOC, 2 * CHUNK)):
            assert engine.lookup(name, [*prompt, 1], tails=True) == hit, name
            engine.release_locks(name, 0, len(prompt) + 1)
        assert stats["chunks"] == 5  # the 3 whole chunks and the tails of "b" and "x"
    finally:
        small.stop()


def test_lookup_locks_the_tail_and_free_locks_release_it(engines, server):
    engine = engines()
    engine.fill(seed=11)
    store_doc(engine)
    prompt = [*DOC, 1]
    assert engine.lookup("r", prompt, tails=True) == STORED
    with AdminClient(server.url) as admin:
        assert admin.stats()["locked_chunks"] == 3
        # A range that ends inside the tail frees the whole chunks and keeps the tail's
        # lock; one that reaches the tail's end frees it.
        engine.release_locks("r", 0, STORED - 1)
        wait_until(lambda: admin.stats()["locked_chunks"] == 1, "the chunks' release")
        engine.release_locks("r", 2 * CHUNK, STORED)
        wait_until(lambda: admin.stats()["locked_chunks"] == 0, "the tail's release")


@pytest.mark.parametrize("case", ["past_tokens", "a_chunk", "end", "groups"])
def test_bad_tails_are_refused_clearly_and_store_nothing(server, case):
    conn = DepotConnection(server.url)
    try:
        caches = {"l0": torch.zeros(16, 2, BLOCK, 64, dtype=torch.bfloat16)}
        instance_id = _two_groups(conn) if case == "groups" else register(conn, caches)
        tail, end = {"past_tokens": (TAIL, STORED), "a_chunk": (CHUNK, 3 * CHUNK),
                     "end": (TAIL, 2 * CHUNK + 16), "groups": (TAIL, STORED)}[case]
        message = {"past_tokens": "past the 138 tokens sent", "a_chunk": "fewer tokens than",
                   "end": "does not end in its tail", "groups": "one KV cache group"}[case]
        sent = DOC[:2 * CHUNK + 10] if case == "past_tokens" else DOC + DOC
        slot, generation = FENCE.begin()
        blocks = list(range(-(-end // BLOCK)))
        extra = {"group_block_ids": [pack_ints(blocks)]} if case == "groups" else {}
        with pytest.raises(InvalidRequest, match=message):
            conn.submit(RequestType.STORE, Store(
                instance_id=instance_id, request_id="bad", token_ids=pack_ints(sent),
                start=0, end=end, block_ids=pack_ints(blocks), fence_slot=slot,
                fence_generation=generation, tail_tokens=tail, **extra)).result(30)
        FENCE.release(slot)
        with AdminClient(server.url) as admin:
            assert admin.stats()["chunks"] == 0
    finally:
        conn.close()


def _two_groups(conn: DepotConnection) -> bytes:
    from tests.support.raw_registration import hand_over_memory

    caches = {"full": torch.zeros(16, 2, BLOCK, 64, dtype=torch.bfloat16),
              "window": torch.zeros(16, 2, BLOCK, 64, dtype=torch.bfloat16)}
    request, _ = hand_over_memory(conn, caches)
    request.layers[1].group = 1
    return conn.submit(RequestType.REGISTER_KV_CACHE, request).result(30).instance_id


def test_tails_survive_a_restart_on_disk(engines_at, tmp_path):
    disk = ("--disk-path", str(tmp_path / "disk"), "--disk-size", "64MiB")
    server = small_server(chunk_size=CHUNK, extra=disk).start()
    try:
        writer = engines_at(server.url)
        writer.fill(seed=12)
        src = store_doc(writer)
        expected = writer.read_blocks(src)
        wait_for_writes(server.url, 3)
    finally:
        server.stop()
    server = small_server(chunk_size=CHUNK, extra=disk).start()
    try:
        reader = engines_at(server.url)
        # The disk tier keeps no index of tail lengths: a longer prompt reads the whole
        # chunks up, and not the tail ...
        assert reader.lookup("longer", [*DOC, 4], tails=True) == 2 * CHUNK
        # ... which its own prompt finds, with the chunks now in CPU memory.
        assert reader.lookup("r", DOC, tails=True) == STORED
        assert reader.retrieve("r", DOC, src, 0, STORED - 1, tail=TAIL) == set()
        assert same(expected, reader.read_blocks(src))
        with AdminClient(server.url) as admin:
            assert admin.stats()["promoted_chunks"] == 3
    finally:
        server.stop()


def test_tails_cross_the_shared_tier(shared_redis_cluster, engines_at):
    extra = ("--remote", shared_redis_cluster.url, "--remote-piece-size", "8KiB")
    node_a = small_server(chunk_size=CHUNK, extra=extra).start()
    node_b = small_server(chunk_size=CHUNK, extra=extra).start()
    try:
        a, b = engines_at(node_a.url), engines_at(node_b.url)
        a.fill(seed=13)
        src = store_doc(a)
        expected = a.read_blocks(src)
        wait_for_writes(node_a.url, 3)
        assert b.lookup("r", DOC, tails=True) == STORED
        dst = [b_ + 20 for b_ in src]
        assert b.retrieve("r", DOC, dst, 0, STORED - 1, tail=TAIL) == set()
        assert same(expected, b.read_blocks(dst))
        stats = node_b.stats()
        assert stats["remote_read_chunks"] == 3 and stats["hit_tails"] == 1
    finally:
        node_a.stop()
        node_b.stop()


def test_a_damaged_tail_in_the_shared_tier_costs_the_tail_only(shared_redis_cluster,
                                                                engines_at):
    # The tail is read with the chunks before it, last: its bad checksum must leave them.
    extra = ("--remote", shared_redis_cluster.url, "--remote-piece-size", "8KiB")
    node_a = small_server(chunk_size=CHUNK, extra=extra).start()
    node_b = small_server(chunk_size=CHUNK, extra=extra).start()
    client = shared_redis_cluster.client()
    try:
        a, b = engines_at(node_a.url), engines_at(node_b.url)
        a.fill(seed=14)
        src = store_doc(a)
        whole = 2 * CHUNK // BLOCK
        expected = a.read_blocks(src[:whole])
        wait_for_writes(node_a.url, 3)
        heads = [name.decode() for name in client.keys(f"{value.KEY_PREFIX}*",
                                                       target_nodes=client.PRIMARIES)
                 if name.count(b":") == 2]
        (tail,) = [name for name in heads
                   if tail_tokens(bytes.fromhex(name.removeprefix(value.KEY_PREFIX))) == TAIL]
        pieces = value.decode_head(client.get(tail)).pieces
        piece = value.piece_keys(bytes.fromhex(tail.removeprefix(value.KEY_PREFIX)), pieces)[0]
        first = client.getrange(piece, 0, 0)
        client.setrange(piece, 0, bytes([first[0] ^ 0xFF]))
        assert b.lookup("r", DOC, tails=True) == 2 * CHUNK
        dst = [b_ + 20 for b_ in src[:whole]]
        assert b.retrieve("r", DOC, dst, 0, 2 * CHUNK) == set()
        assert same(expected, b.read_blocks(dst))
        stats = node_b.stats()
        assert stats["remote_read_chunks"] == 2 and stats["hit_tails"] == 0
        assert stats["remote_discarded_chunks"] == 1
        assert client.exists(tail) == 0  # the damaged value is deleted, not served again
    finally:
        client.close()
        node_a.stop()
        node_b.stop()


def test_a_tail_read_up_past_the_tenants_bound_keeps_no_lock(engines_at, tmp_path):
    # The chunks and the tail after them are read up together; when the tenant's bound on
    # locked memory cuts the hit after the first chunk, the second chunk and the tail must
    # give their locks back (nothing else would: no lookup owns them).
    disk = ("--disk-path", str(tmp_path / "disk"), "--disk-size", "64MiB")
    server = small_server(chunk_size=CHUNK, l1_size="1MiB", extra=disk).start()
    try:
        writer = engines_at(server.url)
        writer.fill(seed=15)
        store_doc(writer)
        wait_for_writes(server.url, 3)
        # Two chunks of 4 blocks each and a tail of 3.
        chunk_bytes = server.stats()["stored_bytes"] * 4 / 11
    finally:
        server.stop()
    share = 1.5 * chunk_bytes / (1 << 20)  # one chunk fits the bound, two do not
    server = small_server(chunk_size=CHUNK, l1_size="1MiB",
                          extra=(*disk, "--max-locked-share", f"{share:.6f}")).start()
    try:
        reader = engines_at(server.url)
        assert reader.lookup("r", DOC, tails=True) == CHUNK
        stats = server.stats()
        assert stats["promoted_chunks"] == 3  # both chunks and the tail came up
        assert stats["lookups_lock_capped"] == 1
        assert stats["locked_chunks"] == 1
        reader.release_locks("r", 0, CHUNK)
        wait_until(lambda: server.stats()["locked_chunks"] == 0, "every lock given back")
    finally:
        server.stop()
