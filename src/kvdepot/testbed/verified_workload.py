"""An engine workload that checks every byte it loads (the soak and the chaos test).

Each block's contents are derived from the tokens it holds (a hash of the prompt up to the
block's end, the layer and the block's place), so a load can be checked without keeping a
copy: a loaded block that differs from what its tokens say is a wrong byte. The workload
also plays vLLM's part in the two ways stale work would show: once a store is reported
finished its blocks are overwritten at once (reused for another request), and once a load
is reported failed its blocks are overwritten with a "recomputed" pattern that must then
stay untouched (checked again a while later, and at the end).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

OP_TIMEOUT = 120.0
"""Seconds one operation may stay unresolved before the workload calls it a hang."""
NEW_PROMPT_SHARE = 0.5
"""Share of checked hits after which the prompt is replaced by a new one."""
DEGRADED_PAUSE = 0.01
QUARANTINE_S = 8.0
"""How long blocks of a failed load are watched before they are used again (longer than
any stall the fault injectors cause)."""


@dataclass
class WorkloadCounts:
    lookups: int = 0
    hits: int = 0
    stores: int = 0
    retrieves: int = 0
    load_errors: int = 0
    verified_blocks: int = 0
    verified_bytes: int = 0
    wrong_loaded_blocks: int = 0
    """Blocks a successful load filled with bytes other than their tokens'."""
    overwritten_recomputed_blocks: int = 0
    """Blocks the engine recomputed after a failed load that something wrote into later."""
    block_bytes: int = 0
    """Bytes of one block across the engine's layers."""
    notes: list[str] = field(default_factory=list)

    @property
    def wrong_blocks(self) -> int:
        return self.wrong_loaded_blocks + self.overwritten_recomputed_blocks

    @property
    def wrong_bytes(self) -> int:
        return self.wrong_blocks * self.block_bytes

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (
            "lookups", "hits", "stores", "retrieves", "load_errors", "verified_blocks",
            "verified_bytes", "wrong_loaded_blocks", "overwritten_recomputed_blocks")} | {
            "wrong_blocks": self.wrong_blocks, "wrong_bytes": self.wrong_bytes,
            "notes": self.notes[:20]}


def _distinct_layers(caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each layer tensor once (aliased layer names share one view)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    layers = []
    for tensor in caches.values():
        ident = (tensor.data_ptr(), tuple(tensor.stride()))
        if ident not in seen:
            seen.add(ident)
            layers.append(tensor)
    return layers


class BlockPatterns:
    """Writes and checks token-derived contents of an engine's KV blocks."""

    def __init__(self, caches: dict[str, torch.Tensor], block_size: int, block_axis: int = 0
                 ) -> None:
        self.layers = _distinct_layers(caches)
        self.block_size = block_size
        self.axis = block_axis
        self.block_bytes = sum(t.select(block_axis, 0).numel() * t.element_size()
                               for t in self.layers)

    def _block(self, layer: torch.Tensor, block_id: int) -> torch.Tensor:
        block = layer.select(self.axis, block_id)
        return block.view(torch.int16) if block.element_size() == 2 else block.view(torch.uint8)

    @staticmethod
    def _fill(view: torch.Tensor, seed: int) -> torch.Tensor:
        n = view.numel()
        values = (torch.arange(n, dtype=torch.int64) * 2654435761 + seed) >> 5
        return (values & (0x7FFF if view.element_size() == 2 else 0x7F)).to(
            view.dtype).view(view.shape)

    @staticmethod
    def token_seed(tokens: np.ndarray, end: int, layer: int) -> int:
        digest = hashlib.blake2b(tokens[:end].tobytes(), digest_size=8,
                                 salt=layer.to_bytes(8, "little")).digest()
        return int.from_bytes(digest, "little") & ((1 << 40) - 1)

    def _seeds(self, tokens: np.ndarray, start: int, count: int) -> list[list[int]]:
        bs = self.block_size
        return [[self.token_seed(tokens, start + (j + 1) * bs, layer)
                 for layer in range(len(self.layers))] for j in range(count)]

    def write_tokens(self, tokens: np.ndarray, start: int, block_ids: list[int]) -> None:
        """Blocks `block_ids` hold tokens [start, start + len * block_size)."""
        for block_id, seeds in zip(block_ids, self._seeds(tokens, start, len(block_ids)),
                                   strict=True):
            for layer, seed in zip(self.layers, seeds, strict=True):
                view = self._block(layer, block_id)
                view.copy_(self._fill(view, seed))

    def wrong_token_blocks(self, tokens: np.ndarray, start: int, block_ids: list[int]) -> int:
        wrong = 0
        for block_id, seeds in zip(block_ids, self._seeds(tokens, start, len(block_ids)),
                                   strict=True):
            for layer, seed in zip(self.layers, seeds, strict=True):
                view = self._block(layer, block_id)
                if not torch.equal(view, self._fill(view, seed)):
                    wrong += 1
                    break
        return wrong

    def write_mark(self, block_ids: list[int], mark: int) -> None:
        for block_id in block_ids:
            for i, layer in enumerate(self.layers):
                view = self._block(layer, block_id)
                view.copy_(self._fill(view, (mark << 20) + i))

    def unmarked_blocks(self, block_ids: list[int], mark: int) -> int:
        bad = 0
        for block_id in block_ids:
            for i, layer in enumerate(self.layers):
                view = self._block(layer, block_id)
                if not torch.equal(view, self._fill(view, (mark << 20) + i)):
                    bad += 1
                    break
        return bad


class VerifiedWorkload:
    """Lookups, loads and stores of a few prompts, through the seed-compatible adapters.

    `worker` and `scheduler` are the adapters; `caches` the registered KV tensors.
    """

    def __init__(self, worker: Any, scheduler: Any, caches: dict[str, torch.Tensor],
                 num_blocks: int, block_size: int, chunk_size: int, seed: int,
                 prompts: int = 6, max_chunks: int = 4, block_axis: int = 0,
                 name: str = "w", prompt_seed: int | None = None) -> None:
        self.worker = worker
        self.scheduler = scheduler
        self.patterns = BlockPatterns(caches, block_size, block_axis)
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.rng = random.Random(seed)
        self.name = name
        # Engines given one prompt seed draw the same prompts, so they hit each other's
        # stores; new prompts keep coming, so stores keep writing chunks not held yet.
        self._prompt_rng = self.rng if prompt_seed is None else random.Random(prompt_seed)
        self._max_chunks = max_chunks
        self.prompts = [self._new_prompt() for _ in range(prompts)]
        self.free = list(range(num_blocks))
        self.quarantine: list[tuple[float, list[int], int]] = []
        self.counts = WorkloadCounts(block_bytes=self.patterns.block_bytes)
        self._ops = 0
        self._marks = 0

    def _new_prompt(self) -> np.ndarray:
        rng = self._prompt_rng
        length = rng.randint(1, self._max_chunks) * self.chunk_size + 1
        return np.array([rng.randrange(1, 50000) for _ in range(length)], dtype=np.int32)

    # ---- blocks -------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        self._release_quarantine(force=False)
        if len(self.free) < n:
            self._release_quarantine(force=True)
        taken = self.rng.sample(self.free, n)
        taken_set = set(taken)
        self.free = [b for b in self.free if b not in taken_set]
        return taken

    def _give_back(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    def _release_quarantine(self, force: bool) -> None:
        now = time.monotonic()
        keep = []
        for since, blocks, mark in self.quarantine:
            if force or now - since >= QUARANTINE_S:
                bad = self.patterns.unmarked_blocks(blocks, mark)
                if bad:
                    self.counts.overwritten_recomputed_blocks += bad
                    self.counts.notes.append(f"{bad} recomputed blocks were overwritten later")
                self._give_back(blocks)
            else:
                keep.append((since, blocks, mark))
        self.quarantine = keep

    def _mark(self) -> int:
        self._marks += 1
        return self._marks

    # ---- operations ---------------------------------------------------------------------
    def _op(self, tokens: np.ndarray, blocks: list[int], end: int) -> Any:
        from kvdepot.client.engine_types import LoadStoreOp

        return LoadStoreOp(token_ids=tokens.tolist(), block_ids=blocks, start=0, end=end)

    def _wait(self, request_id: str, sending: bool) -> None:
        deadline = time.monotonic() + OP_TIMEOUT
        finished = {request_id} if sending else set()
        while True:
            done_sending, done_recving = self.worker.get_finished(finished)
            if request_id in (done_sending if sending else done_recving):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{request_id} was never resolved")
            time.sleep(0.002)

    def _lookup(self, request_id: str, tokens: np.ndarray) -> int:
        self.counts.lookups += 1
        self.scheduler.maybe_submit_lookup_request(request_id, tokens.tolist())
        deadline = time.monotonic() + OP_TIMEOUT
        while (hit := self.scheduler.check_lookup_result(request_id)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"lookup {request_id} never answered")
            time.sleep(0.002)
        return hit

    def step(self) -> None:
        self._ops += 1
        request_id = f"{self.name}-{self._ops}"
        slot = self.rng.randrange(len(self.prompts))
        tokens = self.prompts[slot]
        hit = self._lookup(request_id, tokens)
        if hit:
            self.counts.hits += 1
            blocks = self._take(hit // self.block_size)
            self.patterns.write_mark(blocks, self._mark())  # whatever was there before
            self.counts.retrieves += 1
            self.worker.submit_retrieve_request(request_id, self._op(tokens, blocks, hit), None)
            self._wait(request_id, sending=False)
            if self.worker.get_block_ids_with_load_errors():
                self.counts.load_errors += 1
                mark = self._mark()
                self.patterns.write_mark(blocks, mark)  # what vLLM recomputes
                self.quarantine.append((time.monotonic(), blocks, mark))
            else:
                wrong = self.patterns.wrong_token_blocks(tokens, 0, blocks)
                if wrong:
                    self.counts.wrong_loaded_blocks += wrong
                    self.counts.notes.append(f"{request_id}: {wrong} of {len(blocks)} loaded "
                                             "blocks hold other bytes than their tokens'")
                self.counts.verified_blocks += len(blocks)
                self.counts.verified_bytes += len(blocks) * self.patterns.block_bytes
                self._give_back(blocks)
                # A prompt leaves only after a checked hit: one a stale store wrote junk
                # under stays until a load shows it.
                if self.rng.random() < NEW_PROMPT_SHARE:
                    self.prompts[slot] = self._new_prompt()
        self.scheduler.end_session(request_id)
        self.scheduler.cleanup_lookup_result(request_id)  # as the connector does, once done
        end = (len(tokens) - 1) // self.chunk_size * self.chunk_size
        if end > hit:
            store_id = f"{request_id}-store"
            blocks = self._take(end // self.block_size)
            self.patterns.write_tokens(tokens, 0, blocks)
            self.counts.stores += 1
            self.worker.submit_store_request(store_id, self._op(tokens, blocks, end), None)
            self._wait(store_id, sending=True)
            # Reported finished: vLLM reuses the blocks for another request at once.
            self.patterns.write_mark(blocks, self._mark())
            self._give_back(blocks)
        if not self.worker.is_healthy:
            time.sleep(DEGRADED_PAUSE)  # nothing reaches the server meanwhile

    def run(self, seconds: float, should_stop: Callable[[], bool] = lambda: False
            ) -> WorkloadCounts:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not should_stop():
            self.step()
        return self.counts

    def finish(self) -> WorkloadCounts:
        """Check every block still watched after a failed load (call once the server has
        been running, uninterrupted, for a while)."""
        self._release_quarantine(force=True)
        return self.counts
