"""Subscribing to a server's KV events (`kvdepot serve --kv-events`), and the index of
where chunks live that a router rebuilds from them (docs/kv-events.md).

A subscriber that starts late subscribes first, then asks the replay socket for every
batch from 0 (or from where it stopped) up to the first one it received live, so it
misses nothing the server still keeps; `ChunkIndex.apply` ignores batches it has seen.
"""

from __future__ import annotations

import time

import zmq

from kvdepot.errors import ServerUnavailable
from kvdepot.kv_event_wire import (
    ALL_TIERS,
    DECODER,
    REPLAY_END,
    SEQUENCE,
    TOPIC,
    AllChunksCleared,
    ChunkRemoved,
    ChunkStored,
    EventBatch,
)
from kvdepot.rpc.credentials import Credential

IndexKey = tuple[str, int, bytes]
"""(tenant, rank, chain hash)."""


class KVEventSubscriber:
    """The PUB socket of `url` and its replay socket at `replay_url`; `credential` (an
    admin one) when the server authenticates."""

    def __init__(self, url: str, replay_url: str, credential: Credential | None = None,
                 context: zmq.Context | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self.url, self.replay_url = url, replay_url
        self._credential = credential
        self._sub = self._socket(zmq.SUB, url)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)

    def _socket(self, kind: int, url: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._credential is not None:
            self._credential.apply(sock, url)
        sock.connect(url)
        return sock

    def receive(self, timeout: float) -> tuple[int, EventBatch] | None:
        """The next live batch and its sequence number; None after `timeout` seconds."""
        if not self._sub.poll(int(timeout * 1000)):
            return None
        _, sequence, payload = self._sub.recv_multipart()
        return SEQUENCE.unpack(sequence)[0], DECODER.decode(payload)

    def replay(self, start: int = 0, timeout: float = 10.0) -> list[tuple[int, EventBatch]]:
        """Every batch the server still keeps from sequence number `start` on."""
        sock = self._socket(zmq.DEALER, self.replay_url)
        deadline = time.monotonic() + timeout
        late = ServerUnavailable(f"no end of replay from {self.replay_url} within {timeout} s")
        try:
            # A DEALER's send blocks while it has no peer, and a connection the server
            # refused (a credential that is not an admin's) leaves it none: wait for a
            # peer no longer than the deadline.
            if not sock.poll(int(timeout * 1000), zmq.POLLOUT):
                raise late
            sock.send(SEQUENCE.pack(start), zmq.NOBLOCK)
            batches = []
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    raise late
                sequence, payload = sock.recv_multipart()
                number = SEQUENCE.unpack(sequence)[0]
                if number == REPLAY_END:
                    return batches
                batches.append((number, DECODER.decode(payload)))
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self._sub.close(linger=0)


class ChunkIndex:
    """Which chunks each tier of one server holds, as its events tell."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[IndexKey]] = {}
        self.parents: dict[bytes, bytes | None] = {}
        self.last_sequence = -1
        self.gaps = 0
        """Batches missed (a sequence number skipped) or dropped by the server: while
        nonzero the index may be wrong."""

    def apply(self, sequence: int, batch: EventBatch) -> bool:
        """Apply one batch unless already applied; returns whether it was."""
        if sequence <= self.last_sequence:
            return False
        if sequence != self.last_sequence + 1:
            self.gaps += 1
        self.last_sequence = sequence
        if batch.dropped:
            self.gaps += 1
        for event in batch.events:
            if isinstance(event, ChunkStored):
                held = self.tiers.setdefault(event.tier, set())
                parent = event.parent_hash
                for chain in event.chunk_hashes:
                    held.add((event.tenant, event.rank, chain))
                    self.parents[chain] = parent
                    parent = chain
            elif isinstance(event, ChunkRemoved):
                held = self.tiers.setdefault(event.tier, set())
                for chain in event.chunk_hashes:
                    held.discard((event.tenant, event.rank, chain))
            elif isinstance(event, AllChunksCleared):
                if event.tier == ALL_TIERS:
                    self.tiers.clear()
                else:
                    self.tiers.pop(event.tier, None)
        return True

    def holds(self, tier: str, tenant: str, rank: int, chain: bytes) -> bool:
        return (tenant, rank, chain) in self.tiers.get(tier, ())

    def prefix_chunks(self, tier: str, tenant: str, chains: list[bytes],
                      world_size: int = 1) -> int:
        """How many leading chunks of a prompt (its chain hashes) `tier` holds on every
        rank: what a lookup would find there."""
        held = self.tiers.get(tier, set())
        count = 0
        for chain in chains:
            if not all((tenant, rank, chain) in held for rank in range(world_size)):
                break
            count += 1
        return count
