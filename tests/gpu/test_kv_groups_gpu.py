"""Several KV cache groups on the GPU data path (vLLM's hybrid KV cache manager).

As in vLLM, each group has a name for every layer's memory (one full-attention and one
sliding-window layer share each tensor) and numbers its own blocks. Stores and
retrieves go through the seed-compatible worker adapter with one block list per group
and real interprocess CUDA events; the sliding-window group's list leads with blocks the
engine does not hold, and a retrieve may end inside its last chunk.
"""

from __future__ import annotations

import random
import time

import torch

from kvdepot.integrations.vllm.mp_adapter import LMCacheMPWorkerAdapter, LoadStoreOp
from kvdepot.protocol import NO_BLOCK
from kvdepot.testbed.server_process import ServerProcess
from tests.gpu.support.engine import BLOCKS_PER_CHUNK, CHUNK
from tests.gpu.support.kv_layouts import BLOCK, LAYOUTS, blocks, fill_blocks, same_bits

NUM_BLOCKS = 256
GROUPS = ("full", "window")


class HybridEngine:
    def __init__(self, url: str, layout: str = "flash_attn") -> None:
        self.device = torch.device("cuda", 0)
        torch.cuda.set_device(self.device)
        self.caches = LAYOUTS[layout](NUM_BLOCKS, self.device)
        self.stream = torch.cuda.Stream(self.device)
        named = {f"{group}.{name}": t for group in GROUPS for name, t in self.caches.items()}
        self.adapter = LMCacheMPWorkerAdapter(url, None, f"gpu-groups-{layout}", world_size=1,
                                              kv_rank=0, vllm_block_size=BLOCK)
        self.adapter.register_kv_caches(named, extra_layout_hints={
            "per_layer_kv_cache_group_id": [g for g in range(len(GROUPS))
                                            for _ in self.caches],
            "per_layer_logical_block_size": [BLOCK] * len(named)})
        self._ops = 0

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(interprocess=True)
        event.record(self.stream)
        return event

    def _run(self, store: bool, op: LoadStoreOp) -> set[int]:
        self._ops += 1
        request_id = f"op-{self._ops}"
        submit = self.adapter.submit_store_request if store else (
            self.adapter.submit_retrieve_request)
        submit(request_id, op, self._event())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sending, recving = self.adapter.get_finished({request_id} if store else set())
            if request_id in (sending if store else recving):
                return self.adapter.get_block_ids_with_load_errors()
            time.sleep(0.001)
        raise TimeoutError(f"{request_id} did not finish")

    def store(self, tokens: list[int], groups: list[list[int]], end: int) -> None:
        self._run(True, LoadStoreOp(tokens, groups, 0, end))

    def retrieve(self, tokens: list[int], groups: list[list[int]], end: int) -> set[int]:
        return self._run(False, LoadStoreOp(tokens, groups, 0, end))

    def fill(self, ids: list[int], seed: int) -> None:
        with torch.cuda.stream(self.stream):
            fill_blocks(self.caches, ids, torch.Generator(self.device).manual_seed(seed))

    def snapshot(self, ids: list[int]) -> list[torch.Tensor]:
        self.stream.synchronize()
        return [blocks(t, ids) for t in self.caches.values()]

    def close(self) -> None:
        self.adapter.shutdown()


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(same_bits(x, y) for x, y in zip(a, b, strict=True))


def test_every_group_round_trips_bit_exact(server: ServerProcess) -> None:
    engine = HybridEngine(server.url)
    try:
        rng = random.Random(7)
        n = 2 * BLOCKS_PER_CHUNK
        ids = rng.sample(range(1, NUM_BLOCKS), 4 * n)
        source = [ids[:n], ids[n:2 * n]]
        target_full, target_window = ids[2 * n:3 * n], ids[3 * n:]
        tokens = [rng.randrange(1, 30000) for _ in range(2 * CHUNK)]
        engine.fill(ids, 1)
        engine.store(tokens, source, 2 * CHUNK)
        engine.fill(target_full + target_window, 2)
        # The window group holds only its last blocks; all but the last token is loaded.
        unheld = BLOCKS_PER_CHUNK + 3
        before = engine.snapshot(target_window[:unheld])
        errors = engine.retrieve(tokens, [target_full, [NO_BLOCK] * unheld
                                          + target_window[unheld:]], 2 * CHUNK - 1)
        assert errors == set()
        assert same(engine.snapshot(target_full), engine.snapshot(source[0]))
        assert same(engine.snapshot(target_window[unheld:]),
                    engine.snapshot(source[1][unheld:]))
        assert same(engine.snapshot(target_window[:unheld]), before)
    finally:
        engine.close()


def test_retrieve_ending_inside_a_chunk_writes_no_block_past_its_end(
    server: ServerProcess
) -> None:
    engine = HybridEngine(server.url, "vllm_BLHNC")
    try:
        rng = random.Random(8)
        n = 2 * BLOCKS_PER_CHUNK
        ids = rng.sample(range(1, NUM_BLOCKS), 4 * n)
        source = [ids[:n], ids[n:2 * n]]
        tokens = [rng.randrange(1, 30000) for _ in range(2 * CHUNK)]
        engine.fill(ids, 3)
        engine.store(tokens, source, 2 * CHUNK)
        end = 2 * CHUNK - 2 * BLOCK - 5  # the last 2 blocks of the second chunk not needed
        needed = -(-end // BLOCK)
        targets = [ids[2 * n:3 * n], ids[3 * n:]]
        before = engine.snapshot(targets[0][needed:] + targets[1][needed:])
        assert engine.retrieve(tokens, [t[:needed] for t in targets], end) == set()
        for group, target in enumerate(targets):
            assert same(engine.snapshot(target[:needed]),
                        engine.snapshot(source[group][:needed]))
        assert same(engine.snapshot(targets[0][needed:] + targets[1][needed:]), before)
    finally:
        engine.close()
