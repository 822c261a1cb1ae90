"""The GPU data path end to end: a server process, engine processes, real CUDA IPC."""

from __future__ import annotations

import random
import signal
import subprocess
import time

import pytest
import torch

from kvdepot.integrations.vllm.mp_adapter import LoadStoreOp
from kvdepot.testbed.server_process import ServerProcess
from tests.gpu.support.depot_server import child_env, script
from tests.gpu.support.engine import BLOCKS_PER_CHUNK, CHUNK, Engine
from tests.gpu.support.kv_layouts import BLOCK, LAYOUTS, same_bits


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip_is_bit_exact(server: ServerProcess, layout: str) -> None:
    engine = Engine(server.url, layout)
    try:
        for seed in range(3):
            assert engine.round_trip(seed * 7 + len(layout), chunks=1 + seed)
    finally:
        engine.close()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_tail_round_trip_is_bit_exact(server: ServerProcess, layout: str) -> None:
    """Two whole chunks and a tail of 40 tokens (3 blocks, the last partly) through the
    copy process, then the tail alone with its first block skipped."""
    engine = Engine(server.url, layout)
    try:
        rng = random.Random(len(layout))
        count = 2 * BLOCKS_PER_CHUNK + 3
        ids = rng.sample(range(engine.num_blocks), 2 * count)
        source, target = ids[:count], ids[count:]
        tokens = [rng.randrange(1, 30000) for _ in range(2 * CHUNK + 40)]
        engine.fill(source, 1)
        engine.fill(target, 2)
        engine.store(tokens, source, tail=40)
        engine.retrieve(tokens, target, tail=40)
        assert all(same_bits(a, b) for a, b in zip(engine.snapshot(source),
                                                    engine.snapshot(target), strict=True))
        # The tail into other blocks, its first one shared with a prefix cache: not written.
        again = [b for b in range(engine.num_blocks) if b not in ids][:3]
        engine.fill(again, 3)
        before = engine.snapshot(again[:1])
        engine.retrieve(tokens[:2 * CHUNK + 40], [*target[:2 * BLOCKS_PER_CHUNK], *again],
                        skip=2 * CHUNK + BLOCK, tail=40)
        assert all(same_bits(a, b) for a, b in zip(engine.snapshot(again[:1]), before,
                                                    strict=True))
        assert all(same_bits(a, b) for a, b in zip(engine.snapshot(again[1:]),
                                                    engine.snapshot(source[-2:]), strict=True))
    finally:
        engine.close()


def test_store_waits_for_the_engine_event(server: ServerProcess) -> None:
    """The KV is written by a kernel queued behind about a second of GPU work; the store is
    submitted at once and must still copy what that kernel wrote."""
    engine = Engine(server.url, "flash_attn")
    try:
        ids = list(range(BLOCKS_PER_CHUNK))
        target = list(range(BLOCKS_PER_CHUNK, 2 * BLOCKS_PER_CHUNK))
        tokens = [random.randrange(1, 30000) for _ in range(CHUNK)]
        engine.fill(ids, 1)
        with torch.cuda.stream(engine.stream):
            torch.cuda._sleep(1000)  # load the kernel now, not inside the timed part
            for tensor in engine.caches.values():
                tensor[:, :BLOCKS_PER_CHUNK].fill_(0.0)
        engine.stream.synchronize()
        with torch.cuda.stream(engine.stream):
            torch.cuda._sleep(2_000_000_000)  # about a second
            for tensor in engine.caches.values():
                tensor[:, :BLOCKS_PER_CHUNK].fill_(3.0)
        started = time.monotonic()
        engine.store(tokens, ids)
        waited = time.monotonic() - started
        engine.fill(target, 2)
        engine.retrieve(tokens, target)
        for tensor in engine.caches.values():
            assert bool((tensor[:, BLOCKS_PER_CHUNK:2 * BLOCKS_PER_CHUNK] == 3.0).all()), \
                f"the store copied the blocks before the kernel wrote them ({waited:.3f} s)"
        assert waited > 0.2, f"the store finished after {waited:.3f} s, before the kernel did"
    finally:
        engine.close()


def test_retrieve_never_writes_the_skipped_blocks(server: ServerProcess) -> None:
    engine = Engine(server.url, "flash_attn_shared")
    try:
        source = list(range(2 * BLOCKS_PER_CHUNK))
        target = list(range(100, 100 + 2 * BLOCKS_PER_CHUNK))
        tokens = [random.randrange(1, 30000) for _ in range(2 * CHUNK)]
        engine.fill(source, 5)
        engine.store(tokens, source)
        engine.fill(target, 6)
        skipped_blocks = BLOCKS_PER_CHUNK + 3
        before = engine.snapshot(target[:skipped_blocks])
        engine.retrieve(tokens, target, skip=skipped_blocks * BLOCK)
        after = engine.snapshot(target[:skipped_blocks])
        assert all(same_bits(a, b) for a, b in zip(before, after, strict=True))
        loaded = engine.snapshot(target[skipped_blocks:])
        expected = engine.snapshot(source[skipped_blocks:])
        assert all(same_bits(a, b) for a, b in zip(loaded, expected, strict=True))
    finally:
        engine.close()


def _wait_all(engine: Engine, ids: set[str], store: bool, timeout: float = 60.0) -> None:
    pending = set(ids)
    finished = set(ids) if store else set()
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        sending, recving = engine.adapter.get_finished(finished)
        finished = set()
        pending -= sending if store else recving
        time.sleep(0.001)
    assert not pending, f"{len(pending)} operations did not finish"


def test_operations_in_flight_together_stay_bit_exact(server: ServerProcess) -> None:
    """Several stores, then several retrieves, submitted at once: the server queues each
    behind the previous ones on its streams and reuses its staging buffers across them,
    so any missing wait between operations shows up as wrong bytes."""
    engine = Engine(server.url, "mla", num_blocks=1024)
    try:
        rng = random.Random(41)
        ops, chunks = 6, 3
        per_op = chunks * BLOCKS_PER_CHUNK
        ids = rng.sample(range(engine.num_blocks), 2 * ops * per_op)
        sources = [ids[i * per_op:(i + 1) * per_op] for i in range(ops)]
        targets = [ids[(ops + i) * per_op:(ops + i + 1) * per_op] for i in range(ops)]
        prompts = [[rng.randrange(1, 30000) for _ in range(chunks * CHUNK)] for _ in range(ops)]
        engine.fill([b for s in sources for b in s], 42)
        engine.fill([b for t in targets for b in t], 43)
        stores = {engine.store(p, s, wait=False) for p, s in zip(prompts, sources, strict=True)}
        _wait_all(engine, stores, store=True)
        retrieves = set()
        for i, (p, t) in enumerate(zip(prompts, targets, strict=True)):
            op = LoadStoreOp(token_ids=p, block_ids=t, start=0, end=len(t) * BLOCK)
            engine.adapter.submit_retrieve_request(f"together-{i}", op, engine.event())
            retrieves.add(f"together-{i}")
        _wait_all(engine, retrieves, store=False)
        assert not engine.adapter.get_block_ids_with_load_errors()
        for s, t in zip(sources, targets, strict=True):
            assert all(same_bits(a, b) for a, b in zip(engine.snapshot(s), engine.snapshot(t),
                                                        strict=True))
    finally:
        engine.close()


def _spawn(server: ServerProcess, layout: str, seed: int, rounds: int, *extra: str
           ) -> subprocess.Popen[str]:
    return subprocess.Popen(script("engine", server.url, layout, str(seed), str(rounds), *extra),
                            env=child_env(), stdout=subprocess.PIPE, text=True)


def test_two_engine_processes_store_and_retrieve_concurrently(server: ServerProcess) -> None:
    procs = [_spawn(server, layout, seed, 12)
             for layout, seed in (("flash_attn", 11), ("vllm_BLNHC", 12))]
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
        assert "ok 12" in out


def test_killed_engine_leaves_the_server_healthy_and_frees_its_memory(
        server: ServerProcess) -> None:
    free_before, _ = torch.cuda.mem_get_info()
    # ~2 GiB of KV, so whether its memory comes back is plain in the free-memory figure.
    proc = _spawn(server, "flash_attn", 21, 0, "65536", "--forever")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1.5)  # stores and retrieves are in flight now
    assert server.stats()["registered_engines"] >= 1
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    while server.stats()["registered_engines"] > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.stats()["registered_engines"] == 0, "the dead engine was never reaped"
    while time.monotonic() < deadline:
        if torch.cuda.mem_get_info()[0] > free_before - (512 << 20):
            break
        time.sleep(0.2)
    assert torch.cuda.mem_get_info()[0] > free_before - (512 << 20), \
        "the dead engine's GPU memory is still held"
    assert server.alive()
    engine = Engine(server.url, "mla")
    try:
        assert engine.round_trip(99)
    finally:
        engine.close()
