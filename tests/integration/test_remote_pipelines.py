"""The shared tier's pipelines against real Redis (standalone, and a 3-master cluster with
replicas: one per test process for the tests that do not kill nodes): chunks written and
read in one pipeline or many come back byte-exact; reads restart the TTL; a damaged chunk
ends a promotion where it lies; a head is never sent before its pieces are acknowledged;
a master killed mid-write or mid-read, or frozen mid-read, fails no call and serves no
wrong byte."""

from __future__ import annotations

import functools
import hashlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvdepot.storage.chunk import UNSCOPED
from kvdepot.storage.cpu_tier import CPUTier
from kvdepot.storage.lower_tiers import LowerTiers
from kvdepot.storage.shared import value as shared_value
from kvdepot.storage.shared.address import parse_shared_tier_url
from kvdepot.storage.shared.tier import SharedTier
from kvdepot.transfer.host_pool import allocate_pool

CHUNK_BYTES = (200 << 10) + 3
"""Three pieces sent from the caller's memory (64 KiB each) and a short last one packed
by redis-py."""
PIECE_BYTES = 64 << 10
FINGERPRINT = b"test-layout"


def url_of(redis: Any) -> str:
    return redis.url if hasattr(redis, "url") else f"redis://{redis.address}"


@pytest.fixture(params=["standalone", "cluster"])
def redis(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("redis_server" if request.param == "standalone"
                                   else "shared_redis_cluster")


@pytest.fixture
def tiers() -> Iterator[Callable[..., SharedTier]]:
    made: list[SharedTier] = []

    def make(redis: Any, **options: Any) -> SharedTier:
        options.setdefault("piece_bytes", PIECE_BYTES)
        made.append(SharedTier(parse_shared_tier_url(url_of(redis)), ttl=3600, timeout=5,
                               **options))
        return made[-1]

    yield make
    for tier in made:
        tier.close()


def payloads(count: int, seed: int = 0) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = [hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=34).digest()
            for i in range(count)]
    return keys, [rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8) for _ in range(count)]


def write(tier: SharedTier, keys: list[bytes], data: list[np.ndarray]) -> int:
    return tier.write_many([(key, FINGERPRINT, memoryview(d), UNSCOPED, None)
                            for key, d in zip(keys, data, strict=True)])


def read(tier: SharedTier, keys: list[bytes]) -> tuple[list[bytes | None], list[np.ndarray]]:
    assert tier.stored_sizes(keys) == [CHUNK_BYTES] * len(keys)
    buffers = [np.full(CHUNK_BYTES, 0xEE, dtype=np.uint8) for _ in keys]
    return tier.read_many([(k, memoryview(b)) for k, b in zip(keys, buffers, strict=True)]), \
        buffers


class PipelineLog:
    """Wraps a tier's client, its batches sent to every master at once and its streamed
    reads: each pipeline, batch or read records the keys of its commands, and
    `before_execute(n)` runs before the n-th of them (from 0) is sent."""

    def __init__(self, tier: SharedTier,
                 before_execute: Callable[[int], None] = lambda n: None) -> None:
        self.executed: list[list[str]] = []
        self.before_execute = before_execute
        make = tier._client.pipeline
        tier._client.pipeline = lambda *a, **k: _LoggedPipeline(make(*a, **k), self)
        by_master, stream = tier._by_master, tier._stream

        def logged(jobs: list[Any]) -> list[bool]:
            self.before_execute(len(self.executed))
            self.executed.append([key for key, _, _ in jobs])
            return by_master(jobs)

        def logged_stream(jobs: list[Any], *args: Any) -> None:
            self.before_execute(len(self.executed))
            self.executed.append([key for key, _, _ in jobs])
            stream(jobs, *args)
        tier._by_master = logged  # type: ignore[method-assign]
        tier._stream = logged_stream  # type: ignore[method-assign]


class _LoggedPipeline:
    def __init__(self, pipe: Any, log: PipelineLog) -> None:
        self._pipe, self._log, self._names = pipe, log, []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._pipe, name)
        if name == "execute":
            def execute(*args: Any, **kwargs: Any) -> Any:
                self._log.before_execute(len(self._log.executed))
                self._log.executed.append(self._names)
                return method(*args, **kwargs)
            return execute

        def command(key: str, *args: Any, **kwargs: Any) -> Any:
            self._names.append(key)
            return method(key, *args, **kwargs)
        return command


# ---- byte-exact ------------------------------------------------------------------------------
@pytest.mark.parametrize("window_bytes", [1, 1 << 20, 64 << 20],
                         ids=["one-piece-in-flight", "several-in-flight", "all-in-flight"])
def test_writes_and_streamed_reads_small_and_big_are_byte_exact(redis, tiers, window_bytes):
    keys, data = payloads(12)
    writer = tiers(redis, write_pipeline_bytes=window_bytes)
    log = PipelineLog(writer)
    assert write(writer, keys, data) == 12
    assert writer.status()["written_chunks"] == 12
    # Skipped the second time: every head is there.
    assert write(writer, keys, data) == 0 and writer.status()["present_chunks"] == 12
    assert len(log.executed) > 2
    reader = tiers(redis, read_window_bytes=window_bytes)
    reads = PipelineLog(reader)
    fingerprints, buffers = read(reader, keys)
    assert fingerprints == [FINGERPRINT] * 12
    for expected, got in zip(data, buffers, strict=True):
        assert np.array_equal(expected, got)
    assert reader.status()["read_chunks"] == 12 and reader.status()["discarded_chunks"] == 0
    # One stream (after the heads' lookup) carries every piece and head of the read.
    (streamed,) = reads.executed[1:]
    assert sorted(streamed) == sorted(name for key in keys for name in (
        shared_value.head_key(key), *shared_value.piece_keys(key, 4)))


def test_big_pieces_are_byte_exact(redis, tiers):
    """Pieces of 1 MiB, each received over many system calls, and a short last piece:
    byte-exact."""
    rng = np.random.default_rng(29)
    keys = [hashlib.blake2b(b"big:%d" % i, digest_size=34).digest() for i in range(3)]
    data = [rng.integers(0, 256, (5 << 20) // 2 + 7, dtype=np.uint8) for _ in keys]
    writer, reader = tiers(redis, piece_bytes=1 << 20), tiers(redis, piece_bytes=1 << 20)
    assert writer.write_many([(key, FINGERPRINT, memoryview(d), UNSCOPED, None)
                              for key, d in zip(keys, data, strict=True)]) == 3
    assert reader.stored_sizes(keys) == [len(data[0])] * 3
    buffers = [np.zeros(len(data[0]), dtype=np.uint8) for _ in keys]
    assert reader.read_many([(k, memoryview(b)) for k, b in zip(keys, buffers, strict=True)]
                            ) == [FINGERPRINT] * 3
    for expected, got in zip(data, buffers, strict=True):
        assert np.array_equal(expected, got)


def test_a_slow_reader_keeps_no_more_than_its_window_in_the_servers_output_buffer(
        redis_server, tiers):
    """64 MiB read from one server by a reader that takes 0.3 s over each of its first
    replies: the server never holds much more than the read's window (8 MiB) of replies
    for it (CLIENT LIST's omem), where sending every command at once would have it buffer
    most of the 64 MiB; and the read stays byte-exact."""
    piece, window = 4 << 20, 8 << 20
    rng = np.random.default_rng(37)
    keys = [hashlib.blake2b(b"window:%d" % i, digest_size=34).digest() for i in range(8)]
    data = [rng.integers(0, 256, 2 * piece, dtype=np.uint8) for _ in keys]
    writer = tiers(redis_server, piece_bytes=piece)
    assert writer.write_many([(key, FINGERPRINT, memoryview(d), UNSCOPED, None)
                              for key, d in zip(keys, data, strict=True)]) == 8
    reader = tiers(redis_server, piece_bytes=piece, read_window_bytes=window)
    held: list[int] = []
    stream = reader._stream

    def slow(jobs: list[Any], landed: Any, cutoff: Any) -> None:
        def landed_slowly(index: int, good: bool) -> None:
            landed(index, good)
            if index < 6:
                time.sleep(0.3)  # the server fills what it may meanwhile
                with redis_server.client() as r:
                    held.append(max(int(c["omem"]) for c in r.client_list()))
        stream(jobs, landed_slowly, cutoff)
    reader._stream = slow  # type: ignore[method-assign]
    assert reader.stored_sizes(keys) == [2 * piece] * 8
    buffers = [np.zeros(2 * piece, dtype=np.uint8) for _ in keys]
    assert reader.read_many([(k, memoryview(b)) for k, b in zip(keys, buffers, strict=True)]
                            ) == [FINGERPRINT] * 8
    for expected, got in zip(data, buffers, strict=True):
        assert np.array_equal(expected, got)
    assert len(held) == 6 and max(held) <= window + 2 * piece, held


def test_promotion_through_lower_tiers_is_byte_exact(shared_redis_cluster, tiers):
    keys, data = payloads(9, seed=3)
    assert write(tiers(shared_redis_cluster), keys, data) == 9
    memory = CPUTier(allocate_pool(16 << 20))
    lower = LowerTiers(memory, [tiers(shared_redis_cluster, read_window_bytes=1 << 20)])
    assert lower.bring_up_run([[key] for key in keys], 1) == 9
    pool = memory.pool.numpy()
    for key, expected in zip(keys, data, strict=True):
        (chunk,) = memory.pin([key])
        assert chunk.fingerprint == FINGERPRINT
        assert np.array_equal(pool[chunk.offset:chunk.offset + CHUNK_BYTES], expected)
        memory.unpin([chunk])
    lower.close()


# ---- TTL -------------------------------------------------------------------------------------
def test_reads_restart_the_ttl_of_heads_and_pieces(redis_server, tiers):
    keys, data = payloads(3, seed=5)
    tier = tiers(redis_server)
    write(tier, keys, data)
    names = [name for key in keys for name in (
        shared_value.head_key(key), *shared_value.piece_keys(key, 4))]
    with redis_server.client() as r:
        for name in names:
            assert r.expire(name, 30)
        fingerprints, _ = read(tier, keys)
        assert fingerprints == [FINGERPRINT] * 3
        assert all(3000 < r.ttl(name) <= 3600 for name in names)


# ---- damage ----------------------------------------------------------------------------------
def _flip_a_byte(r: Any, name: str) -> None:
    value = bytearray(r.get(name))
    value[len(value) // 2] ^= 1
    r.set(name, bytes(value))


def _another_type(r: Any, name: str) -> None:
    r.delete(name)
    r.rpush(name, b"not a string")


DAMAGE = {"flipped-byte": _flip_a_byte,
          "cut-short": lambda r, name: r.set(name, r.get(name)[:-1]),
          "missing": lambda r, name: r.delete(name),
          "another-type": _another_type}


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("damaged", [0, 5, 9], ids=["first", "middle", "last"])
def test_a_damaged_piece_mid_promotion_ends_the_run_there(redis, tiers, how, damaged):
    keys, data = payloads(10, seed=7)
    write(tiers(redis), keys, data)
    with redis.client() as r:
        DAMAGE[how](r, shared_value.piece_keys(keys[damaged], 4)[2])
    memory = CPUTier(allocate_pool(16 << 20))
    # A window of one piece per master: the damage is found while later pieces wait.
    reader = tiers(redis, read_window_bytes=1)
    answered: list[str] = []
    stream = reader._stream

    def recorded(jobs: list[Any], landed: Any, cutoff: Any) -> None:
        def landed_and_recorded(index: int, good: bool) -> None:
            answered.append(jobs[index][0])
            landed(index, good)
        stream(jobs, landed_and_recorded, cutoff)
    reader._stream = recorded  # type: ignore[method-assign]
    lower = LowerTiers(memory, [reader])
    assert lower.bring_up_run([[key] for key in keys], 1) == damaged
    if how != "flipped-byte" and not hasattr(redis, "nodes"):
        # One server, one command at a time: a piece that comes back wrong is the last
        # command sent (a flipped byte is found later, by the checksum, on a helper).
        assert answered[-1] == shared_value.piece_keys(keys[damaged], 4)[2]
    pool = memory.pool.numpy()
    for key, expected in zip(keys[:damaged], data[:damaged], strict=True):
        (chunk,) = memory.pin([key])
        assert np.array_equal(pool[chunk.offset:chunk.offset + CHUNK_BYTES], expected)
        memory.unpin([chunk])
    assert not any(memory.contains(key) for key in keys[damaged:])
    s = reader.status()
    assert s["read_chunks"] == damaged and s["discarded_chunks"] == 1
    assert reader.available  # damage is not an outage
    with redis.client() as r:
        assert r.get(shared_value.head_key(keys[damaged])) is None
        assert r.exists(*shared_value.piece_keys(keys[damaged], 4)) == 0
        assert all(r.get(shared_value.head_key(key)) is not None
                   for key in keys[:damaged] + keys[damaged + 1:])
    lower.close()


def test_a_head_of_another_type_is_deleted_not_an_outage(redis, tiers):
    keys, data = payloads(3, seed=8)
    tier = tiers(redis)
    write(tier, keys, data)
    with redis.client() as r:
        _another_type(r, shared_value.head_key(keys[1]))
        assert tier.stored_sizes(keys) == [CHUNK_BYTES, None, CHUNK_BYTES]
        assert r.exists(shared_value.head_key(keys[1])) == 0
    assert tier.available and tier.status()["discarded_chunks"] == 1
    assert write(tier, keys, data) == 1  # written again


# ---- write order -----------------------------------------------------------------------------
@pytest.mark.parametrize("pipeline_bytes", [1, 3 * CHUNK_BYTES, 64 << 20])
def test_heads_are_sent_only_after_their_pieces_were_acknowledged(redis, tiers,
                                                                   pipeline_bytes):
    keys, data = payloads(10, seed=9)
    tier = tiers(redis, write_pipeline_bytes=pipeline_bytes)
    log = PipelineLog(tier)
    assert write(tier, keys, data) == 10
    sent_in: dict[str, int] = {}
    for index, names in enumerate(log.executed[1:], 1):  # after the EXISTS
        for name in names:
            assert name not in sent_in, f"{name} sent twice"
            sent_in[name] = index
    for key in keys:
        head = sent_in[shared_value.head_key(key)]
        pieces = [sent_in[name] for name in shared_value.piece_keys(key, 4)]
        assert max(pieces) < head, "a head went out before (or with) its own pieces"


# ---- failures mid-way ------------------------------------------------------------------------
@pytest.mark.parametrize("killed", ["a-master", "every-node"])
def test_killed_mid_write_fails_no_call_and_serves_no_wrong_byte(redis_cluster, tiers,
                                                                 killed):
    keys, data = payloads(24, seed=11)
    writer = tiers(redis_cluster, write_pipeline_bytes=3 * CHUNK_BYTES)
    victims = ([redis_cluster.master_of(shared_value.head_key(keys[12]))]
               if killed == "a-master" else redis_cluster.nodes)

    # A key of the victim's own slots: WAIT counts only what its caller wrote.
    probe = next(f"probe-{i}" for i in range(10_000)
                 if redis_cluster.master_of(f"probe-{i}") is victims[0]
                 ) if killed == "a-master" else None

    def kill_once_replicated(n: int) -> None:
        if n != 4:
            return
        if killed == "a-master":
            # Its replica first takes what it acknowledged (Redis replicates afterwards,
            # in order: once it has the probe, it has every earlier write). The chunks
            # written before the kill then survive the failover whatever the load on the
            # machine, and are read back below (one run under `make test`'s load found
            # every one of them missing a piece, and so read none).
            with victims[0].client() as master:
                master.set(probe, b"1")
                assert master.execute_command("WAIT", 1, 5000) == 1
        for victim in victims:
            victim.kill()

    PipelineLog(writer, kill_once_replicated)
    written = write(writer, keys, data)
    assert written < 24 and not writer.available
    assert writer.status()["dropped_writes"] == 24 - written
    if killed == "every-node":
        redis_cluster.restart()
    redis_cluster.wait_healthy()
    reader = tiers(redis_cluster)
    sizes = reader.stored_sizes(keys)
    buffers = [np.zeros(CHUNK_BYTES, dtype=np.uint8) for _ in keys]
    found = [(k, b) for k, b, size in zip(keys, buffers, sizes, strict=True) if size]
    fingerprints = reader.read_many([(k, memoryview(b)) for k, b in found])
    checked = 0
    for (key, buffer), fingerprint in zip(found, fingerprints, strict=True):
        if fingerprint is not None:
            assert fingerprint == FINGERPRINT
            assert np.array_equal(buffer, data[keys.index(key)])
            checked += 1
    if killed == "every-node":
        # Restarted without persistence, the cluster keeps nothing: nothing may be
        # promised or read (the byte check above cannot run, and must not be relied on).
        assert sizes == [None] * 24 and checked == 0
    else:
        # The chunks written before the kill whose heads live on the other masters are
        # read back, byte for byte: the check above ran.
        assert checked > 0, (written, sizes)


def act_after_the_last_reply_before(reader: SharedTier, cluster: Any, key: str,
                                    action: Callable[[Any], None]) -> Any:
    """Makes `reader`'s next streamed read run `action(victim)` on the thread of the master
    that serves `key` (the victim), right after it took its last reply before that key's
    job; with one command in flight per master, the victim's next command is not sent yet.
    Returns the victim."""
    victim = cluster.master_of(key)
    stream = reader._stream

    def hooked(jobs: list[Any], landed: Any, cutoff: Any) -> None:
        first = [name for name, _, _ in jobs].index(key)
        last = max(i for i in range(first) if cluster.master_of(jobs[i][0]) is victim)

        def landed_then_act(index: int, good: bool) -> None:
            landed(index, good)
            if index == last:
                action(victim)
        stream(jobs, landed_then_act, cutoff)
    reader._stream = hooked  # type: ignore[method-assign]
    return victim


def test_a_master_killed_mid_read_serves_what_came_before(redis_cluster, tiers):
    keys, data = payloads(12, seed=13)
    assert write(tiers(redis_cluster), keys, data) == 12
    reader = tiers(redis_cluster, read_window_bytes=1)
    killed = threading.Event()

    def kill(victim: Any) -> None:
        victim.kill()
        killed.set()
    act_after_the_last_reply_before(reader, redis_cluster,
                                    shared_value.piece_keys(keys[4], 4)[0], kill)
    fingerprints, buffers = read(reader, keys)
    assert killed.is_set() and not reader.available
    assert fingerprints[:4] == [FINGERPRINT] * 4 and fingerprints[4:] == [None] * 8
    for expected, got in zip(data[:4], buffers[:4], strict=True):
        assert np.array_equal(expected, got)
    assert reader.status()["discarded_chunks"] == 0


def test_a_master_that_stalls_mid_read_ends_the_read_at_its_timeout_and_recovers(
        redis_cluster, tiers):
    """A master frozen (SIGSTOP) in the middle of a streamed read: the read returns once
    its round trip times out (no hang), serves exactly the chunks that landed before, and
    opens the breaker; once the master runs again, the tier reconnects and serves every
    chunk byte-exact."""
    keys, data = payloads(12, seed=31)
    assert write(tiers(redis_cluster), keys, data) == 12
    reader = SharedTier(parse_shared_tier_url(url_of(redis_cluster)), ttl=3600, timeout=0.5,
                        piece_bytes=PIECE_BYTES, read_window_bytes=1)
    stream = reader._stream
    victim = act_after_the_last_reply_before(
        reader, redis_cluster, shared_value.piece_keys(keys[4], 4)[0],
        lambda victim: victim.proc.send_signal(signal.SIGSTOP))
    try:
        fingerprints, buffers = read(reader, keys)
        assert fingerprints[:4] == [FINGERPRINT] * 4 and fingerprints[4:] == [None] * 8
        for expected, got in zip(data[:4], buffers[:4], strict=True):
            assert np.array_equal(expected, got)
        assert not reader.available and reader.status()["discarded_chunks"] == 0
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    reader._stream = stream  # type: ignore[method-assign]
    deadline = time.monotonic() + 60
    while not reader.available:
        assert time.monotonic() < deadline, "the tier never reconnected"
        time.sleep(0.1)
    redis_cluster.wait_healthy()
    fingerprints, buffers = read(reader, keys)
    assert fingerprints == [FINGERPRINT] * 12
    for expected, got in zip(data, buffers, strict=True):
        assert np.array_equal(expected, got)
    reader.close()


def test_several_connections_per_master_are_byte_exact(redis, tiers):
    """A batch dealt out over three connections of each master at once: every piece lands
    in its own chunk's buffer, whichever connection carried it."""
    keys, data = payloads(7, seed=23)
    writer = tiers(redis, connections_per_master=3)
    reader = tiers(redis, connections_per_master=3, read_window_bytes=3 * CHUNK_BYTES)
    assert write(writer, keys, data) == 7
    fingerprints, buffers = read(reader, keys)
    assert fingerprints == [FINGERPRINT] * 7 and reader.available
    for expected, got in zip(data, buffers, strict=True):
        assert np.array_equal(expected, got)


def test_a_stale_slot_table_gets_real_redirections_and_is_redone_through_redis_py(
        shared_redis_cluster, tiers):
    """Every slot pointed at the wrong master in the tier's copy of the cluster's slot
    table: the masters answer MOVED, the batch is redone through redis-py's pipeline
    (which follows the redirection), and writes and reads stay byte-exact."""
    from kvdepot.storage.shared.shard_io import Redirected

    keys, data = payloads(5, seed=17)
    writer = tiers(shared_redis_cluster)
    reader = tiers(shared_redis_cluster, read_window_bytes=1)
    redirected: list[str] = []
    for tier in (writer, reader):
        # The MOVED answers to the tier's own redis-py pipelines (EXISTS, heads) then
        # patch their slots only: no refresh of the whole table, which redis-py runs
        # once due (timed), fixes the pieces' slots before the batch or stream goes out.
        tier._client.reinitialize_steps = 0
        slots = tier._client.nodes_manager.slots_cache
        masters = sorted({nodes[0].name: nodes[0] for nodes in slots.values()}.items())
        wrong = {name: masters[(i + 1) % len(masters)][1]
                 for i, (name, _) in enumerate(masters)}
        for slot, nodes in slots.items():
            slots[slot] = [wrong[nodes[0].name]]
        by_master, stream = tier._by_master, tier._stream

        def watched(jobs: list[Any], *args: Any, run: Any, kind: str) -> Any:
            try:
                return run(jobs, *args)
            except Redirected:
                redirected.append(kind)
                raise
        tier._by_master = functools.partial(  # type: ignore[method-assign]
            watched, run=by_master, kind="batch")
        tier._stream = functools.partial(  # type: ignore[method-assign]
            watched, run=stream, kind="stream")
    assert write(writer, keys, data) == 5
    fingerprints, buffers = read(reader, keys)
    assert set(redirected) == {"batch", "stream"}, "the slot table was not stale"
    assert fingerprints == [FINGERPRINT] * 5 and reader.available
    for expected, got in zip(data, buffers, strict=True):
        assert np.array_equal(expected, got)


def test_a_probe_times_one_value_written_and_read_back_and_leaves_nothing(redis, tiers):
    from kvdepot.storage.shared.tier import PROBE_BYTES

    probe = tiers(redis).probe()
    assert probe is not None and probe.nbytes == PROBE_BYTES
    assert min(probe.round_trip_s, probe.write_s, probe.read_s) > 0
    with redis.client() as client:
        assert list(client.scan_iter(match="kvdepot:probe:*")) == []
