"""Several engines and the ranks of TP groups against one server: the scenarios, run with
CPU engines by tests/integration/test_many_engines.py and with CUDA engines by
tests/gpu/test_many_engines_gpu.py.

Every engine is a process of its own (`EngineProcess`, started through the `engines`
fixture), and every load is compared byte for byte with what that engine (with MLA: the
first rank of its TP group) stored. Engines that must not share entries store different
bytes under the same tokens, so a server that mixed them up hands one the other's bytes.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import torch

from kvdepot.client.admin import AdminClient
from kvdepot.testbed.server_process import ServerProcess
from tests.support.engine import EngineProcess
from tests.support.server import stats
from tests.support.server_stops import stop_inside_copies
from tests.support.waiting import wait_until

BLOCK = 16
"""Tokens per engine block (the engines' default)."""

Start = Callable[..., EngineProcess]
"""The `engines` fixture: starts an engine process, closed at the end of the test."""


# ---- helpers ---------------------------------------------------------------------------
def chunk_size(url: str) -> int:
    with AdminClient(url) as admin:
        return admin.chunk_size()


def start_all(start: Start, specs: list[dict[str, Any]]) -> list[EngineProcess]:
    """Start engine processes side by side (each imports torch and registers for
    seconds); returned in the order of `specs`."""
    with ThreadPoolExecutor(len(specs)) as pool:
        return list(pool.map(lambda spec: start(**spec), specs))


def in_parallel(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls at once, each on a thread of its own (each drives its own engine
    process); their results in order, or the first failure raised."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def prompt(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(tokens)]


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit for bit (NaNs included), layer by layer."""
    return len(a) == len(b) and all(
        torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True))


def round_trip(engine: EngineProcess, name: str, tokens: list[int], src: list[int],
               dst: list[int], seed: int, lookup: bool = True) -> None:
    """Random bytes into `src`, stored under `tokens`; looked up (unless `lookup` is
    False: a rank of a TP group whose other ranks do not store these tokens) and loaded
    into `dst`, which must then hold exactly those bytes."""
    end = len(src) * BLOCK
    engine.fill_blocks(src, seed)
    stored = engine.read_blocks(src)
    engine.fill_value(dst, 0.0)
    engine.store(f"{name}-store", tokens, src, 0, end)
    if lookup:
        hit = engine.lookup(f"{name}-load", tokens)
        assert hit == end, f"{name}: the lookup found {hit} of the {end} tokens just stored"
    errors = engine.retrieve(f"{name}-load", tokens, dst, 0, end)
    assert errors == set(), f"{name}: the load failed for blocks {sorted(errors)}"
    assert same_bytes(stored, engine.read_blocks(dst)), \
        f"{name}: the load brought bytes other than the ones this engine stored"


def pairwise_different(shards: list[list[torch.Tensor]]) -> None:
    """The engines' bytes differ from each other: a load of another's would be seen."""
    for i, a in enumerate(shards):
        for j in range(i + 1, len(shards)):
            assert not same_bytes(a, shards[j]), f"engines {i} and {j} hold the same bytes"


# ---- scenarios -------------------------------------------------------------------------
def independent_engines(start: Start, url: str, count: int, rounds: int = 3,
                        chunks: int = 2, **engine: Any) -> None:
    """`count` engines of different models store and load the same tokens at once, each
    its own bytes; an engine of yet another model finds nothing under those tokens."""
    per_chunk = chunk_size(url) // BLOCK
    src = list(range(chunks * per_chunk))
    dst = list(range(chunks * per_chunk, 2 * chunks * per_chunk))
    specs = [dict(engine, model=f"independent-{i}") for i in range(count)]
    *engines, stranger = start_all(start, [*specs, dict(engine, model="independent-other")])
    prompts = [prompt(100 + r, len(src) * BLOCK + 1) for r in range(rounds)]

    def run(i: int) -> list[torch.Tensor]:
        for r, tokens in enumerate(prompts):
            round_trip(engines[i], f"engine {i} round {r}", tokens, src, dst, 1000 * i + r)
        return engines[i].read_blocks(dst)

    pairwise_different(in_parallel([partial(run, i) for i in range(count)]))
    done = stats(url)
    assert done["stored_chunks"] == count * rounds * chunks, done
    assert done["store_present_chunks"] == 0, "one engine's store was taken for another's"
    assert done["locked_chunks"] == 0
    # Another model, the same tokens: a miss, and its load writes nothing.
    assert stranger.lookup("other", prompts[0]) == 0
    assert stranger.retrieve("other-load", prompts[0], dst, 0, len(dst) * BLOCK) == set(dst)
    assert stranger.blocks_hold(src + dst, 0.0)


def tp_group(start: Start, url: str, tp: int, chunks: int = 3, **engine: Any) -> None:
    """A TP group of `tp` ranks: a chunk is a hit only once every rank stored it, and
    each rank loads exactly its own shard; each rank's load gives back its own locks."""
    chunk = chunk_size(url)
    per_chunk = chunk // BLOCK
    end = chunks * chunk
    src = list(range(chunks * per_chunk))
    dst = list(range(chunks * per_chunk, 2 * chunks * per_chunk))
    ranks = start_all(start, [dict(engine, model="tp-group", world_size=tp, rank=r)
                              for r in range(tp)])
    tokens = prompt(7, end + 1)
    in_parallel([partial(e.fill_blocks, src, 2000 + r) for r, e in enumerate(ranks)])
    shards = [e.read_blocks(src) for e in ranks]
    pairwise_different(shards)
    *first, last = ranks
    scheduler = ranks[0]  # vLLM's scheduler: one per engine, keys without a rank

    # Every rank but the last stores the whole range, the last only its first chunk.
    in_parallel([partial(e.store, "store", tokens, src, 0, end) for e in first]
                + [partial(last.store, "store", tokens, src[:per_chunk], 0, chunk)])
    assert scheduler.lookup("partial", tokens) == chunk, \
        "a chunk counted as a hit before every rank stored it"
    scheduler.call("scheduler", "end_session", "partial")  # drops that lookup's locks
    last.store("store-rest", tokens, src[per_chunk:], chunk, end)
    assert scheduler.lookup("full", tokens) == end

    for e in ranks:
        e.fill_value(dst, 0.0)
    errors = in_parallel([partial(e.retrieve, "full", tokens, dst, 0, end) for e in first])
    assert errors == [set()] * len(first)
    # The ranks that loaded gave back their locks; the last rank's chunks wait for it.
    wait_until(lambda: stats(url)["locked_chunks"] == chunks,
               "only the last rank's chunks staying locked", timeout=10)
    assert last.retrieve("full", tokens, dst, 0, end) == set()
    for r, e in enumerate(ranks):
        assert same_bytes(shards[r], e.read_blocks(dst)), f"rank {r} loaded another shard"
    wait_until(lambda: stats(url)["locked_chunks"] == 0, "every lock given back", timeout=10)
    after = stats(url)
    assert after["stored_chunks"] == tp * chunks and after["store_present_chunks"] == 0


def mla_readers(start: Start, url: str, tp: int, chunks: int = 2, **engine: Any) -> None:
    """MLA: only the first TP rank stores (KV world size 1), every rank loads the same
    latent bytes under the lookup's locks, which allow exactly `tp` reads."""
    chunk = chunk_size(url)
    per_chunk = chunk // BLOCK
    end = chunks * chunk
    src = list(range(chunks * per_chunk))
    dst = list(range(chunks * per_chunk, 2 * chunks * per_chunk))
    ranks = start_all(start, [dict(engine, model="mla-group", use_mla=True, tp_size=tp,
                                   tp_rank=r) for r in range(tp)])
    tokens = prompt(8, end + 1)
    # Every rank has bytes of its own in `src`: a load from anyone but rank 0 shows.
    in_parallel([partial(e.fill_blocks, src, 3000 + r) for r, e in enumerate(ranks)])
    pairwise_different([e.read_blocks(src) for e in ranks])
    latent = ranks[0].read_blocks(src)
    before = stats(url)
    ranks[0].store("store", tokens, src, 0, end)  # the connector stores on rank 0 only
    assert stats(url)["stored_chunks"] - before["stored_chunks"] == chunks

    assert ranks[0].lookup("mla", tokens) == end
    assert stats(url)["locked_chunks"] == chunks
    for e in ranks:
        e.fill_value(dst, 0.0)
    *readers, final = ranks[1:] + ranks[:1]  # rank 0 reads last
    errors = in_parallel([partial(e.retrieve, "mla", tokens, dst, 0, end) for e in readers])
    assert errors == [set()] * len(readers)
    assert stats(url)["locked_chunks"] == chunks, \
        f"the lock was released after {tp - 1} of {tp} TP ranks had read"
    assert final.retrieve("mla", tokens, dst, 0, end) == set()
    assert stats(url)["locked_chunks"] == 0, f"the lock outlived all {tp} reads"
    for r, e in enumerate(ranks):
        assert same_bytes(latent, e.read_blocks(dst)), f"TP rank {r} loaded other bytes"


def _keep_going(engine: EngineProcess, ident: int, src: list[int], dst: list[int],
                stop: threading.Event, lookup: bool, min_rounds: int = 2) -> int:
    """Round trips with fresh tokens and bytes until `stop` is set, and `min_rounds` more
    after; returns how many."""
    rounds = after_stop = 0
    while after_stop < min_rounds:
        if stop.is_set():
            after_stop += 1
        seed = 10_000 * (ident + 1) + rounds
        round_trip(engine, f"engine {ident} round {rounds}", prompt(seed, len(src) * BLOCK + 1),
                   src, dst, seed, lookup=lookup)
        rounds += 1
    return rounds


def rank_killed_mid_transfer(start: Start, server: ServerProcess, victim: dict[str, Any],
                             blocks_per_op: int, ops: int = 2, solos: int = 2,
                             **engine: Any) -> None:
    """Rank 1 of a TP-2 group is SIGKILLed while the server is inside the copies of its
    long stores; rank 0 and `solos` independent engines go on meanwhile. Their operations
    all succeed byte for byte, the server drops the dead rank's registration and keeps
    answering, the dead rank's stores leave either nothing or exactly its bytes, and a
    restarted rank 1 works with rank 0 again. `victim`: rank 1's geometry (big enough
    for `ops` stores of `blocks_per_op` blocks and one more such range)."""
    url = server.url
    per_chunk = chunk_size(url) // BLOCK
    src, dst = list(range(per_chunk)), list(range(per_chunk, 2 * per_chunk))
    group = dict(model="tp-kill", world_size=2)
    rank0, rank1, *others = start_all(start, [
        dict(engine, **group, rank=0), dict(engine, **victim, **group, rank=1),
        *(dict(engine, model=f"solo-{i}") for i in range(solos))])
    tp_round_trip([rank0, rank1], prompt(9, per_chunk * BLOCK + 1), src, dst, 4000)
    registered = stats(url)["registered_engines"]

    stop = threading.Event()
    pool = ThreadPoolExecutor(1 + solos)
    # Rank 0 alone: its tokens are never a hit for the group, so it loads without a lookup.
    going: list[Future[int]] = [pool.submit(_keep_going, rank0, 0, src, dst, stop,
                                            lookup=False)]
    going += [pool.submit(_keep_going, e, 1 + i, src, dst, stop, lookup=True)
              for i, e in enumerate(others)]
    try:
        doomed = [prompt(50 + k, blocks_per_op * BLOCK + 1) for k in range(ops)]
        ranges = [list(range(k * blocks_per_op, (k + 1) * blocks_per_op)) for k in range(ops)]
        for k, (tokens, blocks) in enumerate(zip(doomed, ranges, strict=True)):
            rank1.fill_value(blocks, float(k + 1))
            rank1.submit_store(f"doomed-{k}", tokens, blocks, 0, blocks_per_op * BLOCK)
        ids = [f"doomed-{k}" for k in range(ops)]
        caught = stop_inside_copies(server.pid,
                                    lambda: any(rank1.has_pending_store(r) for r in ids),
                                    inode=rank1.fence_inode())
        try:
            if caught:
                os.kill(rank1.proc.pid, signal.SIGKILL)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert caught, "rank 1's stores all finished before the server was seen copying one"
        rank1.proc.join()
        wait_until(lambda: stats(url)["registered_engines"] == registered - 1,
                   "the killed rank's registration being dropped")
        stop.set()
        rounds = [f.result(timeout=120) for f in going]
    finally:
        stop.set()
        pool.shutdown(wait=True)
    assert server.alive()
    print(f"round trips while rank 1 died: rank 0 {rounds[0]}, the others {rounds[1:]}; "
          f"reaped registrations {stats(url)['reaped_engines']}")

    reborn = start(**dict(engine, **victim, **group, rank=1))
    spare = list(range(ops * blocks_per_op, (ops + 1) * blocks_per_op))
    outcomes = []
    for k, tokens in enumerate(doomed):
        reborn.fill_value(spare, 0.0)
        errors = reborn.retrieve(f"after-{k}", tokens, spare, 0, blocks_per_op * BLOCK)
        if errors:
            assert errors == set(spare)
            outcomes.append("nothing")
        else:
            assert reborn.blocks_hold(spare, float(k + 1)), \
                f"a hit on the killed rank's store {k} loaded bytes it never stored"
            outcomes.append("its bytes")
    print(f"the killed rank's stores left: {outcomes}")
    tp_round_trip([rank0, reborn], prompt(10, per_chunk * BLOCK + 1), src, dst, 5000)
    assert stats(url)["registered_engines"] == registered


def tp_round_trip(ranks: list[EngineProcess], tokens: list[int], src: list[int],
                  dst: list[int], seed: int) -> None:
    """Every rank stores its shard at once; the group's lookup hits all of it; every rank
    loads exactly its own shard."""
    end = len(src) * BLOCK
    in_parallel([partial(e.fill_blocks, src, seed + r) for r, e in enumerate(ranks)])
    shards = [e.read_blocks(src) for e in ranks]
    pairwise_different(shards)
    request = f"tp-{seed}"
    in_parallel([partial(e.store, f"{request}-store", tokens, src, 0, end) for e in ranks])
    assert ranks[0].lookup(request, tokens) == end
    for e in ranks:
        e.fill_value(dst, 0.0)
    errors = in_parallel([partial(e.retrieve, request, tokens, dst, 0, end) for e in ranks])
    assert errors == [set()] * len(ranks)
    for r, e in enumerate(ranks):
        assert same_bytes(shards[r], e.read_blocks(dst)), f"rank {r} loaded another shard"
