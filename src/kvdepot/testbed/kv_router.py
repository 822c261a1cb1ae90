"""A KV-aware router that reads nothing but vLLM's own KV events: the example of
docs/kv-events.md, and the router of `kvdepot bench route`.

Each engine publishes `KVEventBatch`es on ZeroMQ (`--kv-events-config`). Its GPU blocks
and, through KVDepotConnector, the blocks its node's kvdepot holds (medium "CPU", or
"STORAGE" for its disk tier) arrive under vLLM's block hashes. The router hashes a prompt
the way vLLM does and sends it to the engine that holds the longest prefix of it anywhere
on its node; ties go round-robin. No code of kvdepot's is needed to read the events: only vLLM's.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

GPU = "GPU"
"""vLLM's medium for its own blocks (and what an event without a medium means)."""


class PrefixIndex:
    """Per engine, the blocks it holds and in which media, from its events alone."""

    def __init__(self, engines: int) -> None:
        self._held: list[dict[Any, set[str]]] = [{} for _ in range(engines)]
        self._lock = threading.Lock()

    def apply(self, engine: int, batch: KVEventBatch) -> None:
        held = self._held[engine]
        with self._lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    for block in event.block_hashes:
                        held.setdefault(block, set()).add(event.medium or GPU)
                elif isinstance(event, BlockRemoved):
                    for block in event.block_hashes:
                        media = held.get(block)
                        if media is not None:
                            media.discard(event.medium or GPU)
                            if not media:
                                del held[block]
                elif isinstance(event, AllBlocksCleared):
                    # vLLM sends it when its own prefix cache is reset: the GPU blocks go,
                    # what other media hold stays.
                    for block in list(held):
                        held[block].discard(GPU)
                        if not held[block]:
                            del held[block]

    def prefix_blocks(self, engine: int, hashes: Sequence[Any],
                      media: frozenset[str] | None = None) -> int:
        """How many leading blocks of `hashes` the engine holds, in any medium or in one
        of `media`."""
        held = self._held[engine]
        with self._lock:
            for n, block in enumerate(hashes):
                where = held.get(block)
                if not where or (media is not None and not where & media):
                    return n
        return len(hashes)

    def blocks(self, engine: int, medium: str) -> int:
        with self._lock:
            return sum(1 for media in self._held[engine].values() if medium in media)


def prompt_hasher(block_size: int, algorithm: str = "sha256"
                  ) -> Callable[[Sequence[int]], list[Any]]:
    """vLLM's hashes of a prompt's full blocks (no LoRA, multimodal inputs or cache salt),
    as the engines compute them (`prefix_caching_hash_algo`, and PYTHONHASHSEED as the
    engines have it) and as their events carry them (64-bit integers unless
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    hash_fn = get_hash_fn_by_name(algorithm)
    kv_cache_utils.init_none_hash(hash_fn)

    def hashes(tokens: Sequence[int]) -> list[Any]:
        out: list[Any] = []
        parent = None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = kv_cache_utils.hash_block_tokens(hash_fn, parent,
                                                      tokens[start:start + block_size])
            out.append(kv_cache_utils.maybe_convert_block_hash(parent))
        return out

    return hashes


class KVAwareRouter:
    """Subscribes to every engine's KV event publisher and picks an engine per prompt.

    `endpoints`: one per engine, in the engines' order; with `bind`, the router binds
    them and each engine's publisher connects to its own, else the router connects to
    publishers that bound them."""

    def __init__(self, endpoints: list[str], block_size: int, algorithm: str = "sha256",
                 bind: bool = False) -> None:
        self.index = PrefixIndex(len(endpoints))
        self._hashes = prompt_hasher(block_size, algorithm)
        self._turns = itertools.count()
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._ctx = zmq.Context.instance()
        self._sockets = []
        for endpoint in endpoints:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.LINGER, 0)
            if bind:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
            self._sockets.append(sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="kv-router", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                _, _, payload = sock.recv_multipart()
                self.index.apply(self._sockets.index(sock), self._decoder.decode(payload))

    def choose(self, tokens: Sequence[int], media: frozenset[str] | None = None
               ) -> tuple[int, int]:
        """(engine, blocks of the prompt it holds): the longest held prefix, in any medium
        or in one of `media`, ties in turn."""
        hashes = self._hashes(tokens)
        held = [self.index.prefix_blocks(e, hashes, media) for e in range(len(self._sockets))]
        best = max(held)
        ties = [e for e, n in enumerate(held) if n == best]
        return ties[next(self._turns) % len(ties)], best

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in self._sockets:
            sock.close(linger=0)
