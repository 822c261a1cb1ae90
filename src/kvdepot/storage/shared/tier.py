"""The shared tier: chunks in a Redis or Valkey server or cluster, seen by every node.

Values follow `value` (a head and pieces spread over the shards). Lookups' heads
go out as redis-py pipelines, which the cluster client splits per shard: one round trip
per shard whatever the number of chunks. Pieces move through `shard_io`, every master's
share on its own connection and thread at once: writes in batches of about 64 MiB (a
batch's heads follow once its pieces are acknowledged), reads as a stream per master
(`read`), each piece received straight into its place in CPU memory and hashed
there by the thread that received it, each chunk verified once its last piece lands. A
value that fails its checksum (or is short, or of another format) is deleted, counted,
and a miss. Every failure of the server opens the circuit breaker; while it is open the
tier answers "nothing here" at once and drops writes (`available` is False).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from kvdepot.keys import ChunkKey
from kvdepot.log_limiter import LogLimiter
from kvdepot.metrics import Counter, MetricsRegistry
from kvdepot.storage.chunk import UNSCOPED
from kvdepot.storage.shared import shard_io, value
from kvdepot.storage.shared.address import SharedTierAddress, connect
from kvdepot.storage.shared.circuit_breaker import CircuitBreaker
from kvdepot.storage.shared.read import StreamedRead, Verdict
from kvdepot.storage.tier import ChunkWrite, LowerTier, Probe

log = logging.getLogger(__name__)
damage_log = LogLimiter(log)

WRITE_PIPELINE_BYTES = 64 << 20
"""Payload bytes per write pipeline: enough to keep every shard busy, little enough
that one batch's buffers and a shard's input buffer stay small."""
READ_WINDOW_BYTES = 32 << 20
"""Payload bytes a read keeps in flight on each master: a few pieces queued behind the
one being sent, so the master never waits for the next command, and no more than this
in its output buffer per reader."""
HELPER_THREADS = 1
"""Threads encoding a write batch's heads (hashing its pieces) while the batch is sent:
one batch is written at a time. Reads hash on the threads that receive."""
IO_THREADS = 32
"""Threads sending to and receiving from the masters (one per connection of a batch or
a stream; write-behind and promotion may each have one in flight)."""
CONNECTIONS_PER_MASTER = 1
"""Connections a batch uses on each master at once. One event loop serves each Redis
master; more connections did not read faster, with or without Redis's `io-threads`
(measured in docs/shared-tier.md)."""
FAILURES = (RedisError, RedisClusterException, OSError)
"""What redis-py raises when a server or the cluster cannot answer (the cluster client's
own exception is not a RedisError)."""
PROBE_BYTES = 1 << 20
"""The value written and read back once when the tier starts (`probe`): big enough that
its time is mostly transfer on a slow link, small enough to cost nothing on a fast one."""
HEADS_REMEMBERED = 65536
"""Heads read by `stored_sizes` and kept for the `read_many` that follows."""


class SharedTier(LowerTier):
    name = "shared"

    def __init__(self, address: SharedTierAddress, *, ttl: float, timeout: float,
                 piece_bytes: int, ca_file: str | None = None,
                 metrics: MetricsRegistry | None = None,
                 read_window_bytes: int = READ_WINDOW_BYTES,
                 write_pipeline_bytes: int = WRITE_PIPELINE_BYTES,
                 connections_per_master: int = CONNECTIONS_PER_MASTER) -> None:
        self.address = address
        self.connections_per_master = connections_per_master
        self.ttl = max(1, int(ttl))
        self.timeout = timeout
        self.piece_bytes = piece_bytes
        self.read_window_bytes = read_window_bytes
        self.write_pipeline_bytes = write_pipeline_bytes
        self._helper = ThreadPoolExecutor(HELPER_THREADS, thread_name_prefix="kvdepot-shared")
        self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvdepot-shared-io")
        self._ca_file = ca_file
        metrics = metrics or MetricsRegistry()
        self._counters: dict[str, Counter] = {
            name: metrics.counter(f"shared_{name}") for name in (
                "written_chunks", "written_bytes", "present_chunks", "read_chunks",
                "read_bytes", "read_seconds", "discarded_chunks", "dropped_writes", "errors",
                "breaker_opens")}
        self._any_tier_discarded = metrics.counter("lower_tier_discarded_chunks")
        self._heads: OrderedDict[ChunkKey, value.Head] = OrderedDict()
        self._heads_mutex = threading.Lock()
        self._client: Any = None
        self.breaker = CircuitBreaker(self.name, self._reconnect,
                                      opens=self._counters["breaker_opens"])
        value.prepare_placement()
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

    def probe(self) -> Probe | None:
        if not self.available:
            return None
        key = f"kvdepot:probe:{uuid.uuid4().hex}"
        payload = os.urandom(PROBE_BYTES)
        try:
            started = time.perf_counter()
            self._client.exists(key)
            wrote = time.perf_counter()
            self._client.set(key, payload, ex=60)
            read = time.perf_counter()
            answer = self._client.get(key)
            done = time.perf_counter()
            self._client.delete(key)
        except FAILURES as exc:
            self._fail(exc)
            return None
        if answer != payload:
            return None
        probe = Probe(PROBE_BYTES, wrote - started, read - wrote, done - read)
        seconds_per_piece = self.piece_bytes / PROBE_BYTES * max(probe.write_s, probe.read_s)
        if seconds_per_piece > self.timeout:
            log.warning("the shared tier moved %.1f MB/s when probed: a piece of %d bytes "
                        "would take %.1f s, longer than --shared-tier-timeout %.1f s; raise the "
                        "timeout or lower --shared-tier-piece-size, or its writes and reads will "
                        "time out", PROBE_BYTES / max(probe.write_s, probe.read_s) / 1e6,
                        self.piece_bytes, seconds_per_piece, self.timeout)
        return probe

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
        self._helper.shutdown()
        self._io.shutdown()
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
            raw = _answers(pipe)
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

    def stored_sizes_of_each(self, keys: list[ChunkKey]) -> list[int | None]:
        return self.stored_sizes(keys)  # one pipeline, which answers every key

    def read_into(self, key: ChunkKey, fingerprint_out: bytearray, buffer: memoryview) -> bool:
        (fingerprint,) = self.read_many([(key, buffer)])
        if fingerprint is None:
            return False
        fingerprint_out[:] = fingerprint
        return True

    def read_many(self, reads: list[tuple[ChunkKey, memoryview]]) -> list[bytes | None]:
        """Every piece streamed from its master straight into its buffer (`shard_io.
        stream_by_master`, about `read_window_bytes` in flight per master), each piece
        hashed as it lands and each chunk verified once its last piece has, while the
        rest is still on the network (`StreamedRead`). The first chunk that fails ends
        the read: nothing after it is sent, and later chunks answer None (a run ends
        there anyway). GETEX and EXPIRE start the TTL of what was read again (a chunk promoted
        anywhere stays)."""
        out: list[bytes | None] = [None] * len(reads)
        if not reads or not self.available:
            return out
        with self._heads_mutex:
            heads = [self._heads.pop(key, None) for key, _ in reads]
        planned: list[tuple[int, value.Head]] = []
        for i, ((_, buffer), head) in enumerate(zip(reads, heads, strict=True)):
            if head is None or head.payload_bytes != len(buffer):
                break  # never asked about, or another size than the caller expects
            planned.append((i, head))
        if not planned:
            return out
        read = StreamedRead(reads, planned, self.ttl)
        started = time.perf_counter()
        redirected = False
        try:
            self._stream(read.jobs, read.landed, read.cutoff)
        except shard_io.Redirected:
            redirected = True
        except FAILURES as exc:
            self._fail(exc)
        finally:
            verdicts = read.verdicts()  # every master's thread is done with the buffers
        if redirected:
            try:
                verdicts = self._read_through_redis_py(reads, planned)
            except FAILURES as exc:
                self._fail(exc)
                verdicts = [None] * len(planned)
        self._counters["read_seconds"].add(time.perf_counter() - started)
        damaged: list[tuple[ChunkKey, int | None]] = []
        for (i, head), verdict in zip(planned, verdicts, strict=True):
            key, buffer = reads[i]
            if verdict is not True:
                if verdict is False:
                    damaged.append((key, head.pieces))
                break
            out[i] = head.fingerprint
            self._counters["read_chunks"].add()
            self._counters["read_bytes"].add(len(buffer))
        self._discard(damaged, "a missing or short piece, or a checksum that does not match")
        return out

    def _stream(self, jobs: list[shard_io.Job], landed: Callable[[int, bool], None],
                cutoff: shard_io.Cutoff) -> None:
        """A read streamed from every master at once (the tests watch reads here)."""
        shard_io.stream_by_master(self._io, self._client, jobs, self.read_window_bytes,
                                  landed, cutoff, self.connections_per_master)

    def _by_master(self, jobs: list[shard_io.Job]) -> list[bool]:
        """One batch on every master at once (the tests watch batches here)."""
        return shard_io.run_by_master(self._io, self._client, jobs, self.connections_per_master)

    def _read_through_redis_py(self, reads: list[tuple[ChunkKey, memoryview]],
                               planned: list[tuple[int, value.Head]]) -> list[Verdict]:
        """The read redone through redis-py's pipelines of about `read_window_bytes` (a
        slot moved: redis-py follows the redirection and reloads the topology), up to
        the first chunk that fails."""
        verdicts: list[Verdict] = [None] * len(planned)
        first = 0
        while first < len(planned):
            last, group_bytes = first, planned[first][1].payload_bytes
            while last + 1 < len(planned) and group_bytes < self.read_window_bytes:
                last += 1
                group_bytes += planned[last][1].payload_bytes
            group = planned[first:last + 1]
            raw, at = self._fetch(reads, group), 0
            for position, (i, head) in enumerate(group, first):
                key, buffer = reads[i]
                verdicts[position] = (_assemble(head, raw[at:at + head.pieces], buffer)
                                      and value.verify(key, head, buffer))
                at += head.pieces + 1
                if not verdicts[position]:
                    return verdicts
            first = last + 1
        return verdicts

    def _fetch(self, reads: list[tuple[ChunkKey, memoryview]],
               group: list[tuple[int, value.Head]]) -> list[Any]:
        """Per chunk of `group`: its pieces, then the answer to its head's EXPIRE."""
        pipe = self._client.pipeline(transaction=False)
        for i, head in group:
            key = reads[i][0]
            for name in value.piece_keys(key, head.pieces):
                pipe.getex(name, ex=self.ttl)
            pipe.expire(value.head_key(key), self.ttl)
        return _answers(pipe)

    def _discard(self, damaged: list[tuple[ChunkKey, int | None]], what: str) -> None:
        """Delete damaged chunks (`None` pieces: the head could not say how many; those
        pieces age out through their TTL)."""
        if not damaged:
            return
        self._counters["discarded_chunks"].add(len(damaged))
        self._any_tier_discarded.add(len(damaged))
        damage_log.warning("damaged-shared-chunk", "shared tier: deleted %d chunks with %s",
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
        the rest go out in pipelines of about `write_pipeline_bytes`."""
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
        batches: list[list[ChunkWrite]] = []
        batch_bytes = self.write_pipeline_bytes
        for item in missing:
            if batch_bytes >= self.write_pipeline_bytes:
                batches.append([])
                batch_bytes = 0
            batches[-1].append(item)
            batch_bytes += len(item[2])
        written = self._send(batches)
        self._counters["dropped_writes"].add(len(missing) - written)
        return written

    def _send(self, batches: list[list[ChunkWrite]]) -> int:
        """Each batch's pieces in one pipeline while a helper thread computes their
        heads; a batch's heads ride in the next pipeline, sent only once every shard
        acknowledged that batch's pieces (shards answer a pipeline in parallel, so a
        head sent with its pieces could be visible, or survive a crash, without them).
        Returns how many chunks have their heads written."""
        written = 0
        heads: list[tuple[str, bytes, int]] = []  # the previous batch's: name, value, bytes
        for batch in [*batches, []] if batches else []:
            making = self._helper.submit(self._heads_of, batch)
            commands: list[shard_io.Job] = [
                (name, ("SET", name, head, "EX", self.ttl), None) for name, head, _ in heads]
            for key, _, data, *_ in batch:
                count = value.piece_count(len(data), self.piece_bytes)
                for index, name in enumerate(value.piece_keys(key, count)):
                    start = index * self.piece_bytes
                    piece = data[start:start + self.piece_bytes]
                    commands.append((name, ("SET", name, piece, "EX", self.ttl), None))
            try:
                try:
                    self._by_master(commands)
                except shard_io.Redirected:  # a slot moved: redis-py follows it
                    pipe = self._client.pipeline(transaction=False)
                    for _, command, _ in commands:
                        pipe.execute_command(*command)
                    pipe.execute()
            except FAILURES as exc:
                self._fail(exc)
                return written
            finally:
                made = making.result()  # it reads memory the caller unpins once we return
            written += len(heads)
            self._counters["written_chunks"].add(len(heads))
            self._counters["written_bytes"].add(sum(nbytes for *_, nbytes in heads))
            heads = made
        return written

    def _heads_of(self, batch: list[ChunkWrite]) -> list[tuple[str, bytes, int]]:
        """On the helper thread: each chunk's head key, head value and payload bytes."""
        return [(value.head_key(key), value.encode_head(key, fingerprint, data,
                                                        self.piece_bytes)[0], len(data))
                for key, fingerprint, data, *_ in batch]


def _answers(pipe: Any) -> list[Any]:
    """What a pipeline of reads answered. A key holding another type than a string
    (something else wrote under kvdepot's prefix) answers b"", which no head or piece
    passes for: that chunk is damaged, not the server unreachable. Any other error
    raises."""
    answers = pipe.execute(raise_on_error=False)
    for index, answer in enumerate(answers):
        if isinstance(answer, ResponseError) and str(answer).startswith("WRONGTYPE"):
            answers[index] = b""
        elif isinstance(answer, Exception):
            raise answer
    return answers


def _assemble(head: value.Head, pieces: list[Any], buffer: memoryview) -> bool:
    """The pieces copied into `buffer` by numpy (which lets go of the GIL while it
    copies); False if one is missing or of another length."""
    target = np.frombuffer(buffer, np.uint8)
    for index, piece in enumerate(pieces):
        start, end = head.piece_span(index)
        if not isinstance(piece, bytes) or len(piece) != end - start:
            return False
        target[start:end] = np.frombuffer(piece, np.uint8)
    return True
