"""A minimal GPU engine worker: KV caches, a compute stream, and the seed adapter.

Stores and retrieves go through `LMCacheMPWorkerAdapter` with a real interprocess CUDA
event recorded on the engine's stream, as a vLLM connector does. Runnable as a script
(`python -m tests.gpu.support.engine URL LAYOUT SEED ROUNDS [BLOCKS] [--forever]`, the
command `depot_server.script("engine", ...)` gives) for tests that need several engine
processes or one to kill.
"""

from __future__ import annotations

import random
import sys
import time

import torch

from kvdepot.integrations.vllm.mp_adapter import LMCacheMPWorkerAdapter, LoadStoreOp
from tests.gpu.support.kv_layouts import BLOCK, LAYOUTS, blocks, fill_blocks, same_bits

CHUNK = 256
BLOCKS_PER_CHUNK = CHUNK // BLOCK


class Engine:
    def __init__(self, url: str, layout: str, num_blocks: int = 256, model: str = "",
                 device: int = 0, heartbeat_interval: float | None = None,
                 caches: dict[str, torch.Tensor] | None = None) -> None:
        """`caches`: KV tensors made elsewhere (driver-mapped ones, say) instead of
        `layout`'s, which then only names the model."""
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        self.caches = caches if caches is not None else LAYOUTS[layout](num_blocks, self.device)
        self.num_blocks = num_blocks
        self.stream = torch.cuda.Stream(self.device)
        extra = {} if heartbeat_interval is None else {"heartbeat_interval": heartbeat_interval}
        self.adapter = LMCacheMPWorkerAdapter(url, None, model or f"gpu-test-{layout}",
                                              world_size=1, kv_rank=0, vllm_block_size=BLOCK,
                                              **extra)
        self.adapter.register_kv_caches(self.caches)
        self._ops = 0

    def event(self) -> torch.cuda.Event:
        """An interprocess event marking everything queued on the engine stream so far."""
        event = torch.cuda.Event(interprocess=True)
        event.record(self.stream)
        return event

    def _wait(self, request_id: str, store: bool, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sending, recving = self.adapter.get_finished({request_id} if store else set())
            if request_id in (sending if store else recving):
                return
            time.sleep(0.001)
        raise TimeoutError(f"{'store' if store else 'retrieve'} {request_id} did not finish")

    def _end(self, block_ids: list[int], tail: int) -> int:
        """Where the range of `block_ids` ends: whole blocks, or a tail of `tail` tokens
        held in its last -(-tail // BLOCK) blocks."""
        if not tail:
            return len(block_ids) * BLOCK
        return (len(block_ids) - -(-tail // BLOCK)) * BLOCK + tail

    def store(self, tokens: list[int], block_ids: list[int], wait: bool = True,
              tail: int = 0) -> str:
        self._ops += 1
        request_id = f"store-{self._ops}"
        op = LoadStoreOp(token_ids=tokens, block_ids=block_ids, start=0,
                         end=self._end(block_ids, tail), tail_tokens=tail)
        self.adapter.submit_store_request(request_id, op, self.event())
        if wait:
            self._wait(request_id, store=True)
        return request_id

    def retrieve(self, tokens: list[int], block_ids: list[int], skip: int = 0, tail: int = 0
                 ) -> None:
        self._ops += 1
        request_id = f"retrieve-{self._ops}"
        op = LoadStoreOp(token_ids=tokens, block_ids=block_ids, start=0,
                         end=self._end(block_ids, tail), skip_first_n_tokens=skip,
                         tail_tokens=tail)
        self.adapter.submit_retrieve_request(request_id, op, self.event())
        self._wait(request_id, store=False)
        errors = self.adapter.get_block_ids_with_load_errors()
        if errors:
            raise RuntimeError(f"retrieve {request_id} failed for blocks {sorted(errors)}")

    def fill(self, block_ids: list[int], seed: int) -> None:
        generator = torch.Generator(self.device).manual_seed(seed)
        with torch.cuda.stream(self.stream):
            fill_blocks(self.caches, block_ids, generator)

    def snapshot(self, block_ids: list[int]) -> list[torch.Tensor]:
        self.stream.synchronize()
        return [blocks(t, block_ids) for t in self.caches.values()]

    def round_trip(self, seed: int, chunks: int = 2) -> bool:
        """Store random blocks, retrieve them into other blocks, compare every bit."""
        rng = random.Random(seed)
        ids = rng.sample(range(self.num_blocks), 2 * chunks * BLOCKS_PER_CHUNK)
        source, target = ids[:len(ids) // 2], ids[len(ids) // 2:]
        tokens = [rng.randrange(1, 30000) for _ in range(chunks * CHUNK)]
        self.fill(source, seed)
        self.fill(target, seed + 1)
        self.store(tokens, source)
        self.retrieve(tokens, target)
        return all(same_bits(a, b) for a, b in zip(self.snapshot(source),
                                                    self.snapshot(target), strict=True))

    def close(self) -> None:
        self.adapter.shutdown()


def main() -> int:
    url, layout, seed, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    forever = "--forever" in sys.argv
    num_blocks = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5].isdigit() else 256
    caches = None
    if layout == "driver_mapped":  # vLLM 0.34's extensible KV cache (vmm_memory.py)
        from tests.gpu.support.vmm_memory import DriverMappedKV

        caches = DriverMappedKV(num_blocks, torch.device("cuda", 0)).caches
    engine = Engine(url, layout, num_blocks=num_blocks, caches=caches)
    print("ready", flush=True)
    i = 0
    while forever or i < rounds:
        if not engine.round_trip(seed * 100003 + i, chunks=4 if forever else 2):
            print(f"mismatch in round {i}", flush=True)
            return 1
        i += 1
    print(f"ok {i}", flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
