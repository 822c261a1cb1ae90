"""Block events: the chunks that enter and leave the CPU and disk tiers, named by vLLM's own
block hashes, for the engines to pass on in vLLM's KV events (docs/kv-events.md).

A store may carry the vLLM hashes of its blocks. The log keeps them with each chunk for as
long as some tier holds it (`block_hash_bytes`: the hashes themselves, 32 bytes per vLLM
block at most), so whichever engine of the tenant polls (TAKE_BLOCK_EVENTS) can report a
removal, whoever stored the chunk. Only rank 0's chunks are reported: a router wants one
event per prefix, not one per tensor-parallel slice.

Each tenant has a bounded log of events with sequence numbers; every poller keeps its own
place in it. A poller that is slow or away costs nothing: the oldest events are dropped
and the poller that missed them is told how many (`block_events_dropped`). A store never
waits for anyone: the tiers call in under their own mutex and the log only appends.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass

from kvdepot.errors import InvalidRequest
from kvdepot.keys import HASH_BYTES, ChunkKey, key_rank, tail_tokens
from kvdepot.metrics import Counter
from kvdepot.protocol import (
    MAX_BLOCK_EVENTS_REPLY,
    MAX_BLOCK_HASH_BYTES,
    BlockEvent,
    BlockEvents,
)
from kvdepot.storage.chunk import ChunkScope
from kvdepot.storage.tier import TierListener

MEDIA = {"cpu": "CPU", "disk": "DISK"}
"""The tiers whose chunks are reported, and vLLM's name for each. The shared tier is not
reported: a node cannot see the cluster evict, so a router would keep its blocks forever."""
EVENTS_PER_TENANT = 16384
"""Events kept per tenant for pollers that are behind (each a few hundred bytes)."""
PENDING_CHUNKS = 65536
"""Hashes of chunks whose store has not committed yet (or failed): the oldest are forgotten."""


def hash_width(hashes: bytes | memoryview, block_size: int, tokens: int, chunk_size: int
               ) -> int:
    """The length of each vLLM block hash of a store or lookup, once checked: `hashes`
    holds one per `block_size` tokens of the `tokens` it covers, all of one length of at
    most MAX_BLOCK_HASH_BYTES; InvalidRequest, saying what is wrong, otherwise."""
    if block_size <= 0 or chunk_size % block_size:
        raise InvalidRequest(f"hash_block_size {block_size} does not divide the chunk size "
                             f"{chunk_size}")
    blocks = tokens // block_size
    width = len(hashes) // blocks if blocks else 0
    if not blocks or width * blocks != len(hashes) or not 1 <= width <= MAX_BLOCK_HASH_BYTES:
        raise InvalidRequest(
            f"block_hashes: {len(hashes)} bytes are not {blocks} hashes of 1 to "
            f"{MAX_BLOCK_HASH_BYTES} bytes each (one per {block_size} of {tokens} tokens)")
    return width


@dataclass(slots=True)
class _Hashes:
    blocks: bytes
    """The chunk's vLLM block hashes, concatenated."""
    width: int
    block_size: int
    parent: bytes | None
    tenant: str
    media: frozenset[str] = frozenset()

    def split(self) -> list[bytes]:
        return [self.blocks[i:i + self.width] for i in range(0, len(self.blocks), self.width)]


class _TenantLog:
    def __init__(self) -> None:
        self.events: collections.deque[BlockEvent] = collections.deque(maxlen=EVENTS_PER_TENANT)
        self.next = 0
        """The sequence number the next event gets; the oldest kept is next - len(events)."""


class BlockEventLog:
    """A `TierListener` that turns what the tiers tell it into block events per tenant."""

    def __init__(self, dropped: Counter | None = None) -> None:
        self.dropped = dropped or Counter()
        self._lock = threading.Lock()
        self._pending: OrderedDict[ChunkKey, _Hashes] = OrderedDict()
        self._held: dict[ChunkKey, _Hashes] = {}
        self._logs: dict[str, _TenantLog] = {}
        self._hash_bytes = 0

    @property
    def hash_bytes(self) -> int:
        """Memory the kept hashes take (the bytes of the hashes)."""
        return self._hash_bytes

    # ---- what stores bring ----------------------------------------------------------------
    def learn(self, keys: list[ChunkKey], tenant: str, hashes: bytes, width: int,
              block_size: int, previous: ChunkKey | None, parent: bytes | None = None
              ) -> None:
        """The hashes of `keys` (consecutive chunks of one prompt, about to be stored),
        `len(hashes) // len(keys)` bytes per chunk, `width` per block; `previous`: the key
        of the chunk before the first (None at the prompt's start), whose last block hash
        is the first block's parent where it is known; `parent`: that hash, if the caller
        knows it."""
        if not keys or key_rank(keys[0]) != 0:
            return
        per_chunk = len(hashes) // len(keys)
        with self._lock:
            before = (self._held.get(previous) or self._pending.get(previous)
                      if previous is not None and parent is None else None)
            if before is not None:
                parent = before.blocks[-before.width:]
            for i, key in enumerate(keys):
                blocks = hashes[i * per_chunk:(i + 1) * per_chunk]
                if key not in self._held and key not in self._pending:
                    self._pending[key] = _Hashes(blocks, width, block_size, parent, tenant)
                    self._hash_bytes += len(blocks)
                parent = blocks[-width:]
            while len(self._pending) > PENDING_CHUNKS:
                _, forgotten = self._pending.popitem(last=False)
                self._hash_bytes -= len(forgotten.blocks)

    # ---- TierListener ---------------------------------------------------------------------
    def stored(self, tier: str, key: ChunkKey, scope: ChunkScope, parent: bytes | None
               ) -> None:
        medium = MEDIA.get(tier)
        if medium is None or len(key) <= HASH_BYTES or key_rank(key) != 0:
            return
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                entry = self._pending.pop(key, None)
                if entry is None:
                    return  # stored without hashes (or found on disk at start)
                self._held[key] = entry
            if medium in entry.media:
                return
            entry.media = entry.media | {medium}
            self._append(entry, stored=True, medium=medium)

    def removed(self, tier: str, chunks: list[tuple[ChunkKey, str]]) -> None:
        medium = MEDIA.get(tier)
        if medium is None:
            return
        with self._lock:
            for key, _ in chunks:
                entry = self._held.get(key)
                if entry is None or medium not in entry.media:
                    continue
                entry.media = entry.media - {medium}
                self._append(entry, stored=False, medium=medium)
                if not entry.media:
                    del self._held[key]
                    self._hash_bytes -= len(entry.blocks)

    def _append(self, entry: _Hashes, stored: bool, medium: str) -> None:
        log = self._logs.get(entry.tenant)
        if log is None:
            log = self._logs[entry.tenant] = _TenantLog()
        log.events.append(BlockEvent(stored, medium, entry.split(),
                                     entry.parent if stored else None, entry.block_size))
        log.next += 1

    # ---- pollers ----------------------------------------------------------------------------
    def take(self, tenant: str, after: int) -> BlockEvents:
        """The tenant's events after sequence number `after` (-1: the oldest kept), at
        most MAX_BLOCK_EVENTS_REPLY of them."""
        with self._lock:
            log = self._logs.get(tenant)
            if log is None:
                return BlockEvents([], -1, 0)
            oldest = log.next - len(log.events)
            if after >= log.next:  # a place in an earlier server's log: start again
                after = -1
            first = max(after + 1, oldest)
            if first >= log.next:
                return BlockEvents([], after, 0)
            dropped = oldest - (after + 1) if after >= 0 and after + 1 < oldest else 0
            events = list(itertools.islice(log.events, first - oldest,
                                           first - oldest + MAX_BLOCK_EVENTS_REPLY))
        if dropped:
            self.dropped.add(dropped)
        return BlockEvents(events, first + len(events) - 1, dropped)


class TierListeners:
    """Tells each of its listeners (the KV event publisher, the block event log) what a
    tier tells it of whole chunks; the tiers take one listener. Tails are left out: no
    chunk chains from one, and each is superseded by its chunk (docs/design.md)."""

    def __init__(self, *listeners: TierListener | None) -> None:
        self._listeners = [listener for listener in listeners if listener is not None]

    def stored(self, tier: str, key: ChunkKey, scope: ChunkScope, parent: bytes | None
               ) -> None:
        if tail_tokens(key):
            return
        for listener in self._listeners:
            listener.stored(tier, key, scope, parent)

    def removed(self, tier: str, chunks: list[tuple[ChunkKey, str]]) -> None:
        chunks = [chunk for chunk in chunks if not tail_tokens(chunk[0])]
        if not chunks:
            return
        for listener in self._listeners:
            listener.removed(tier, chunks)
