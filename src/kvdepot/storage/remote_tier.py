"""The shared tier: chunks in a Redis or Valkey server or cluster, seen by every node.

Values follow `remote_value` (a head and pieces spread over the shards). Every batch
is one redis-py pipeline, which the cluster client splits per shard and sends to all
of them before reading any answer: a lookup's heads cost one round trip per shard, its
payloads another, whatever the number of chunks. Reads verify the checksum and a
value that fails it (or is short, or of another format) is deleted, counted, and a
miss. Every failure of the server opens the circuit breaker; while it is open the
tier answers "nothing here" at once and drops writes (`available` is False).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from redis.exceptions import RedisClusterException, RedisError

from kvdepot.keys import ChunkKey
from kvdepot.log_limiter import LogLimiter
from kvdepot.metrics import Counter, MetricsRegistry
from kvdepot.storage import remote_value as value
from kvdepot.storage.chunk import UNSCOPED
from kvdepot.storage.circuit_breaker import CircuitBreaker
from kvdepot.storage.remote_address import RemoteAddress, connect
from kvdepot.storage.tier import ChunkWrite, LowerTier

log = logging.getLogger(__name__)
damage_log = LogLimiter(log)

WRITE_PIPELINE_BYTES = 64 << 20
"""Payload bytes per write pipeline: enough to keep every shard busy, little enough
that one batch's buffers and a shard's input buffer stay small."""
FAILURES = (RedisError, RedisClusterException, OSError)
"""What redis-py raises when a server or the cluster cannot answer (the cluster client's
own exception is not a RedisError)."""
HEADS_REMEMBERED = 65536
"""Heads read by `stored_sizes` and kept for the `read_many` that follows."""


class RemoteTier(LowerTier):
    name = "remote"

    def __init__(self, address: RemoteAddress, *, ttl: float, timeout: float,
                 piece_bytes: int, ca_file: str | None = None,
                 metrics: MetricsRegistry | None = None) -> None:
        self.address = address
        self.ttl = max(1, int(ttl))
        self.timeout = timeout
        self.piece_bytes = piece_bytes
        self._ca_file = ca_file
        metrics = metrics or MetricsRegistry()
        self._counters: dict[str, Counter] = {
            name: metrics.counter(f"remote_{name}") for name in (
                "written_chunks", "written_bytes", "present_chunks", "read_chunks",
                "read_bytes", "discarded_chunks", "dropped_writes", "errors", "breaker_opens")}
        self._any_tier_discarded = metrics.counter("lower_tier_discarded_chunks")
        self._heads: OrderedDict[ChunkKey, value.Head] = OrderedDict()
        self._heads_mutex = threading.Lock()
        self._client: Any = None
        self.breaker = CircuitBreaker(self.name, self._reconnect,
                                      opens=self._counters["breaker_opens"])
        try:
            self._client = connect(address, timeout, ca_file)
            self._client.ping()
        except FAILURES as exc:
            self._fail(exc)

    # ---- health ---------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self.breaker.closed

    def _fail(self, exc: BaseException) -> None:
        self._counters["errors"].add()
        self.breaker.failed(f"{type(exc).__name__}: {exc}")

    def _reconnect(self) -> None:
        """The breaker's probe: a fresh client (a new view of the cluster's topology) whose
        primaries all answer."""
        client = connect(self.address, self.timeout, self._ca_file)
        try:
            if self.address.cluster:
                # Every primary answers and sees the whole keyspace served (a cluster whose
                # nodes are back but not yet agreed would fail the next read).
                states = client.cluster_info(target_nodes=client.PRIMARIES)
                if len(states) == 1 and "cluster_state" in states:
                    states = {"": states}
                bad = [node for node, info in states.items() if info.get("cluster_state") != "ok"]
                if bad:
                    raise ConnectionError(f"cluster state not ok on {', '.join(bad)}")
            else:
                client.ping()
        except BaseException:
            client.close()
            raise
        old, self._client = self._client, client
        if old is not None:
            old.close()

    def count_dropped(self, chunks: int) -> None:
        self._counters["dropped_writes"].add(chunks)

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.address.display,
            "cluster": self.address.cluster,
            "breaker": "closed" if self.breaker.closed else "open",
            "open_seconds": round(self.breaker.open_seconds, 3),
            "last_error": self.breaker.last_error,
            "ttl_seconds": self.ttl,
            "piece_bytes": self.piece_bytes,
            "write_queue_chunks": self.queued_writes(),
            **{name: counter.value for name, counter in self._counters.items()},
        }

    def close(self) -> None:
        self.breaker.close()
        if self._client is not None:
            self._client.close()

    # ---- lookups --------------------------------------------------------------------------
    def stored_size(self, key: ChunkKey) -> int | None:
        return self.stored_sizes([key])[0]

    def stored_sizes(self, keys: list[ChunkKey]) -> list[int | None]:
        if not keys or not self.available:
            return [None] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(value.head_key(key))
            raw = pipe.execute()
        except FAILURES as exc:
            self._fail(exc)
            return [None] * len(keys)
        sizes: list[int | None] = []
        damaged = []
        for key, found in zip(keys, raw, strict=True):
            head = value.decode_head(found) if found is not None else None
            if found is not None and head is None:
                damaged.append((key, None))
            if head is None:
                sizes.append(None)
                continue
            sizes.append(head.payload_bytes)
            with self._heads_mutex:
                self._heads[key] = head
                self._heads.move_to_end(key)
                if len(self._heads) > HEADS_REMEMBERED:
                    self._heads.popitem(last=False)
        self._discard(damaged, "a head of another format or cut short")
        return sizes

    def read_into(self, key: ChunkKey, fingerprint_out: bytearray, buffer: memoryview) -> bool:
        (fingerprint,) = self.read_many([(key, buffer)])
        if fingerprint is None:
            return False
        fingerprint_out[:] = fingerprint
        return True

    def read_many(self, reads: list[tuple[ChunkKey, memoryview]]) -> list[bytes | None]:
        """Every piece of every chunk in one pipeline, each copied into its buffer as it
        is taken from the answer; the TTL of what was read starts again (a chunk
        promoted anywhere stays)."""
        out: list[bytes | None] = [None] * len(reads)
        if not reads or not self.available:
            return out
        planned: list[tuple[int, value.Head, list[str]]] = []
        with self._heads_mutex:
            heads = [self._heads.pop(key, None) for key, _ in reads]
        try:
            pipe = self._client.pipeline(transaction=False)
            for i, ((key, buffer), head) in enumerate(zip(reads, heads, strict=True)):
                if head is None or head.payload_bytes != len(buffer):
                    continue  # never asked about, or another size than the caller expects
                names = value.piece_keys(key, head.pieces)
                for name in names:
                    pipe.get(name)
                planned.append((i, head, names))
            for i, _, names in planned:
                for name in (value.head_key(reads[i][0]), *names):
                    pipe.expire(name, self.ttl)
            raw = pipe.execute() if planned else []
        except FAILURES as exc:
            self._fail(exc)
            return out
        damaged = []
        at = 0
        for i, head, names in planned:
            key, buffer = reads[i]
            pieces = raw[at:at + len(names)]
            at += len(names)
            if self._assemble(head, pieces, buffer) and value.verify(key, head, buffer):
                out[i] = head.fingerprint
                self._counters["read_chunks"].add()
                self._counters["read_bytes"].add(len(buffer))
            else:
                damaged.append((key, head.pieces))
        self._discard(damaged, "a missing or short piece, or a checksum that does not match")
        return out

    @staticmethod
    def _assemble(head: value.Head, pieces: list[bytes | None], buffer: memoryview) -> bool:
        for index, piece in enumerate(pieces):
            start, end = head.piece_span(index)
            if piece is None or len(piece) != end - start:
                return False
            buffer[start:end] = piece
        return True

    def _discard(self, damaged: list[tuple[ChunkKey, int | None]], what: str) -> None:
        """Delete damaged chunks (`None` pieces: the head could not say how many; those
        pieces age out through their TTL)."""
        if not damaged:
            return
        self._counters["discarded_chunks"].add(len(damaged))
        self._any_tier_discarded.add(len(damaged))
        damage_log.warning("damaged-remote-chunk", "remote tier: deleted %d chunks with %s",
                           len(damaged), what)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, pieces in damaged:
                pipe.delete(value.head_key(key))
                for name in value.piece_keys(key, pieces) if pieces else []:
                    pipe.delete(name)
            pipe.execute()
        except FAILURES as exc:
            self._fail(exc)

    # ---- writes ---------------------------------------------------------------------------
    def write(self, key: ChunkKey, fingerprint: bytes, data: memoryview) -> None:
        self.write_many([(key, fingerprint, data, UNSCOPED, None)])

    def write_many(self, writes: list[ChunkWrite]) -> int:
        """Chunks the server already has are skipped (one EXISTS per chunk, pipelined);
        the rest go out in pipelines of about `WRITE_PIPELINE_BYTES`."""
        if not writes:
            return 0
        if not self.available:
            self._counters["dropped_writes"].add(len(writes))
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, *_ in writes:
                pipe.exists(value.head_key(key))
            present = pipe.execute()
        except FAILURES as exc:
            self._fail(exc)
            self._counters["dropped_writes"].add(len(writes))
            return 0
        missing = [w for w, found in zip(writes, present, strict=True) if not found]
        self._counters["present_chunks"].add(len(writes) - len(missing))
        written = 0
        batch: list[ChunkWrite] = []
        batch_bytes = 0
        for item in missing:
            batch.append(item)
            batch_bytes += len(item[2])
            if batch_bytes >= WRITE_PIPELINE_BYTES or item is missing[-1]:
                if not self._send(batch):
                    self._counters["dropped_writes"].add(len(missing) - written)
                    return written
                written += len(batch)
                batch, batch_bytes = [], 0
        return written

    def _send(self, batch: list[ChunkWrite]) -> bool:
        """The pieces, then (once every shard has acknowledged them) the heads: shards
        answer a pipeline in parallel, so a head sent with its pieces could be visible
        before them."""
        try:
            pieces = self._client.pipeline(transaction=False)
            heads = self._client.pipeline(transaction=False)
            for key, fingerprint, data, *_ in batch:
                head, count = value.encode_head(key, fingerprint, data, self.piece_bytes)
                for index, name in enumerate(value.piece_keys(key, count)):
                    start = index * self.piece_bytes
                    pieces.set(name, data[start:start + self.piece_bytes], ex=self.ttl)
                heads.set(value.head_key(key), head, ex=self.ttl)
            pieces.execute()
            heads.execute()
        except FAILURES as exc:
            self._fail(exc)
            return False
        self._counters["written_chunks"].add(len(batch))
        self._counters["written_bytes"].add(sum(len(item[2]) for item in batch))
        return True
