"""Bounds: no message, field, count or client can make the server do unbounded work.

Each test reproduces a finding of issue 9 (4, 5, 7, 8) with a real server process and
real sockets. Time limits here are hang guards, generous next to what the server needs.
"""

import os
import signal
import time

import msgspec
import pytest
import torch
import zmq

from kvdepot.errors import ErrorKind, InvalidRequest
from kvdepot.integrations.vllm.mp_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
)
from kvdepot.protocol import REQUEST_HEADER, Empty, KeyScope, Lookup, RequestType, pack_ints
from tests.support.raw import RawSocket, descriptors_of, memory_kib
from tests.support.server import running_server, small_server, stats

CHUNK = 64
TOKENS = list(range(700, 700 + 4 * CHUNK + 1))
HANG_GUARD = 30.0


# ---- finding 4: one message stalls the control loop -----------------------------------
def test_a_huge_block_report_is_refused_without_stalling_the_control_loop(server):
    reporter, pinger = RawSocket(server.url), RawSocket(server.url)
    records = [[f"req-{i}", [i], [i, i + 1]] for i in range(1_000_000)]
    reporter.send(1, RequestType.REPORT_BLOCK_ALLOCATION,
                  msgspec.msgpack.encode([os.getpid(), "m", records]))
    time.sleep(0.05)  # let the report arrive first
    sent = time.monotonic()
    pinger.send(2, RequestType.PING, Empty())
    assert pinger.reply(HANG_GUARD) is not None
    # A hang guard, not a speed goal: the report must not be decoded on the loop at all.
    assert time.monotonic() - sent < 1.0
    got = reporter.reply(HANG_GUARD)
    assert got is not None and got[1] == ErrorKind.MALFORMED_PAYLOAD
    assert b"at most" in got[2]
    reporter.close()
    pinger.close()


def test_a_big_block_report_travels_in_bounded_parts(server):
    from kvdepot.client.engine_types import BlockAllocationRecord

    scheduler = LMCacheMPSchedulerAdapter(server.url, zmq.Context.instance(), "m",
                                          vllm_block_size=16, mq_timeout=HANG_GUARD)
    # 3,000 records of 1,000 tokens (12 MB packed) and one record too big for any report.
    records = [BlockAllocationRecord(f"r{i}", list(range(63)), list(range(1000)))
               for i in range(3000)]
    records.append(BlockAllocationRecord("huge", [1], list(range(1 << 19))))
    scheduler.report_block_allocations(records)
    assert scheduler.check_lookup_result("none") == 0  # a later call reads the notices' replies
    deadline = time.monotonic() + HANG_GUARD
    while stats(server.url)["block_allocation_reports"] < 3000:
        assert time.monotonic() < deadline, "the reports never all arrived"
        time.sleep(0.05)
    assert stats(server.url)["block_allocation_reports"] == 3000
    scheduler.shutdown()


# ---- finding 5: a tiny REGISTER takes O(N) memory; blocks named twice ----------------
def _register(url: str, caches: dict[str, torch.Tensor]) -> None:
    worker = LMCacheMPWorkerAdapter(url, zmq.Context.instance(), "m", vllm_block_size=16,
                                    mq_timeout=HANG_GUARD)
    try:
        worker.register_kv_caches(caches)
    finally:
        worker.close()


def test_zero_and_overlapping_strides_are_refused_before_any_work(server):
    pid = server.proc.pid
    peak_before = memory_kib(pid, "VmHWM")
    # 2 blocks whose second dimension (40,000 long) has stride 0: 1 KiB of real memory,
    # but enumerating its elements would take hundreds of MB.
    zero = torch.zeros(2, 1, 16, 8).expand(2, 40_000, 16, 8)
    with pytest.raises(InvalidRequest, match="zero stride"):
        _register(server.url, {"layer": zero})
    overlapping = torch.as_strided(torch.zeros(4096), (2, 16, 8), (1024, 4, 1))
    with pytest.raises(InvalidRequest, match="overlapping strides"):
        _register(server.url, {"layer": overlapping})
    assert memory_kib(pid, "VmHWM") - peak_before < 32 << 10


def test_an_operation_naming_a_block_twice_is_refused(engines, server):
    engine = engines(num_blocks=32)
    engine.fill(seed=5)
    engine.store("dup", TOKENS, [0, 1, 2, 3, 4, 5, 6, 0], 0, 2 * CHUNK)
    after = stats(server.url)
    assert after["chunks"] == 0 and after["store_errors"] == 1
    engine.store("ok", TOKENS, list(range(8)), 0, 2 * CHUNK)
    assert engine.lookup("r", TOKENS) == 2 * CHUNK
    errors = engine.retrieve("r", TOKENS, [9, 10, 11, 12, 13, 14, 15, 9], 0, 2 * CHUNK)
    assert errors == {9, 10, 11, 12, 13, 14, 15}
    assert stats(server.url)["retrieve_errors"] == 1


# ---- finding 7: no caps per client -----------------------------------------------------
def test_huge_request_ids_and_model_names_are_refused_at_decoding(server):
    raw = RawSocket(server.url)
    rss_before = memory_kib(server.proc.pid)
    for i in range(50):
        status, message = raw.call(RequestType.LOOKUP, Lookup(
            f"{i}-" + "x" * 200_000, KeyScope("m", 1), pack_ints(TOKENS), 1))
        assert status == ErrorKind.MALFORMED_PAYLOAD and "length <=" in message
    status, message = raw.call(RequestType.LOOKUP, Lookup(
        "r", KeyScope("m" * 100_000, 1), pack_ints(TOKENS), 1))
    assert status == ErrorKind.MALFORMED_PAYLOAD
    assert stats(server.url)["lookup_jobs"] == 0
    assert memory_kib(server.proc.pid) - rss_before < 32 << 10
    raw.close()


def test_lookup_jobs_per_connection_are_bounded(server):
    from kvdepot.server.lookups import MAX_JOBS_PER_CONNECTION

    raw = RawSocket(server.url)
    extra = 50
    body = {}
    for i in range(MAX_JOBS_PER_CONNECTION + extra):
        body[i] = Lookup(f"job-{i}", KeyScope("m", 1), b"", 1)
        raw.send(i, RequestType.LOOKUP, body[i])
    answers = {}
    while len(answers) < len(body):
        got = raw.reply(HANG_GUARD)
        assert got is not None, f"only {len(answers)} of {len(body)} lookups were answered"
        answers[got[0]] = (got[1], msgspec.msgpack.decode(got[2]))
    assert all(status == 0 and value == 0 for status, value in answers.values())
    after = stats(server.url)
    assert after["lookup_jobs"] == MAX_JOBS_PER_CONNECTION
    assert after["lookups_refused"] == extra
    # Another connection is not affected; ending a session makes room again.
    other = RawSocket(server.url)
    assert other.call(RequestType.LOOKUP, Lookup("other", KeyScope("m", 1), b"", 1)) == (0, 0)
    assert stats(server.url)["lookup_jobs"] == MAX_JOBS_PER_CONNECTION + 1
    raw.close()
    other.close()


def test_one_connection_cannot_lock_more_than_its_share_of_memory(engines_at):
    # 1 MiB of CPU memory holds 32 chunks of this engine (32 KiB each).
    with running_server(l1_size="1MiB", chunk_size=CHUNK,
                        extra=("--max-locked-share", "0.5")) as server:
        engine = engines_at(server.url, num_blocks=128)
        engine.fill(seed=7)
        first = list(range(10_000, 10_000 + 32 * CHUNK + 1))
        engine.store("fill", first, list(range(128)), 0, 32 * CHUNK)
        assert stats(server.url)["chunks"] == 32
        greedy = RawSocket(server.url)
        status, hit = greedy.call(RequestType.LOOKUP, Lookup(
            "greedy", KeyScope("test-model", 1), pack_ints(first), 1024))
        assert status == 0 and hit == 16
        after = stats(server.url)
        assert after["locked_chunks"] == 16 and after["lookups_lock_capped"] == 1
        # Every other engine's stores still find room among the unlocked half.
        second = list(range(50_000, 50_000 + 8 * CHUNK + 1))
        engine.store("more", second, list(range(32)), 0, 8 * CHUNK)
        after = stats(server.url)
        assert after["store_skipped_full_chunks"] == 0 and after["stored_chunks"] == 40
        greedy.close()


def test_registrations_per_connection_are_bounded(server):
    from kvdepot.protocol import RequestType as Request
    from kvdepot.rpc.connection import DepotConnection
    from kvdepot.server.engines import MAX_REGISTRATIONS_PER_CONNECTION
    from tests.support.raw_registration import FENCE, WAIT, hand_over_memory
    from tests.support.waiting import wait_until

    # A worker's own re-registrations replace each other; a client registering anew on one
    # connection, again and again, is what the cap stops. What the server holds is counted
    # by file (inode), so a registration of some other client cannot blur it.
    conn = DepotConnection(server.url)
    caches = {"layer": torch.zeros(8, 2, 16, 16)}
    fence = os.fstat(FENCE.fd).st_ino

    def register() -> set[int]:
        """Registers once; returns the inodes of the KV memory it handed over."""
        request, fds = hand_over_memory(conn, caches)
        kv = {os.fstat(fd).st_ino for fd in fds} - {fence}
        conn.submit(Request.REGISTER_KV_CACHE, request).result(WAIT)
        return kv

    kv = register()
    fence_descriptors = descriptors_of(server.proc.pid, {fence})[fence]
    for _ in range(MAX_REGISTRATIONS_PER_CONNECTION - 1):
        kv |= register()
    assert len(kv) == MAX_REGISTRATIONS_PER_CONNECTION
    # Each registration holds its KV memory's file; the fence they all name is one file,
    # held as the first registration holds it: a descriptor of it handed over again
    # closes as soon as no slot is locked, which on a loaded host may come a moment after
    # the registration's reply.
    wait_until(lambda: descriptors_of(server.proc.pid, {fence})[fence] == fence_descriptors,
               "the fence's copies closed")
    assert set(descriptors_of(server.proc.pid, kv).values()) == {1}
    # The refused one holds nothing: refusals cannot pile descriptors up.
    request, fds = hand_over_memory(conn, caches)
    refused = {os.fstat(fd).st_ino for fd in fds} - {fence}
    with pytest.raises(InvalidRequest, match="most one connection may"):
        conn.submit(Request.REGISTER_KV_CACHE, request).result(WAIT)
    wait_until(lambda: set(descriptors_of(server.proc.pid, refused).values()) == {0},
               "the refused registration's files closed")
    assert descriptors_of(server.proc.pid, {fence})[fence] == fence_descriptors
    assert set(descriptors_of(server.proc.pid, kv).values()) == {1}  # still registered
    conn.close()


# ---- finding 8: malformed frames, degraded scheduler, abandoned lookups ----------------
def test_malformed_frames_get_an_error_reply_and_rate_limited_logs():
    server = small_server(chunk_size=CHUNK).start()
    try:
        raw = RawSocket(server.url)
        raw.send_frames([REQUEST_HEADER.pack(41, RequestType.PING)])  # no payload frame
        got = raw.reply(HANG_GUARD)
        assert got is not None and got[:2] == (41, ErrorKind.MALFORMED_PAYLOAD)
        raw.send_frames([REQUEST_HEADER.pack(42, RequestType.PING), b"\x90", b"x", b"y"])
        got = raw.reply(HANG_GUARD)
        assert got is not None and got[:2] == (42, ErrorKind.MALFORMED_PAYLOAD)
        for _ in range(2000):
            raw.send_frames([b"junk"])
            raw.send(43, RequestType.LOOKUP, b"\xc1")
        replies = 0
        while raw.reply(5.0) is not None:
            replies += 1
            if replies == 2000:
                break
        assert replies == 2000  # every malformed LOOKUP answered, the junk dropped
        assert raw.call(RequestType.PING, Empty())[0] == 0
        raw.close()
    finally:
        output = server.stop()
    dropped = [line for line in output.splitlines() if "not a kvdepot request" in line]
    rejected = [line for line in output.splitlines() if "malformed LOOKUP" in line]
    assert 1 <= len(dropped) <= 3 and 1 <= len(rejected) <= 3, output[-2000:]


def test_a_scheduler_that_made_no_call_recovers_after_an_outage():
    server = small_server(chunk_size=CHUNK).start()
    scheduler = LMCacheMPSchedulerAdapter(server.url, zmq.Context.instance(), "m",
                                          vllm_block_size=16, mq_timeout=5.0,
                                          heartbeat_interval=0.5)
    try:
        server.kill()
        deadline = time.monotonic() + HANG_GUARD
        while scheduler.is_healthy:
            assert time.monotonic() < deadline, "the client never noticed the outage"
            time.sleep(0.02)
        server = small_server(port=server.port, chunk_size=CHUNK).start()
        deadline = time.monotonic() + HANG_GUARD
        while not scheduler.is_healthy:
            assert time.monotonic() < deadline, "still degraded although the server is back"
            time.sleep(0.05)
    finally:
        scheduler.shutdown()
        server.stop()


def test_a_lookup_the_client_gave_up_on_releases_its_locks(engines, server):
    engine = engines(mq_timeout=0.5, heartbeat_interval=2.0)
    engine.fill(seed=8)
    engine.store("w", TOKENS, list(range(16)), 0, 4 * CHUNK)
    assert engine.lookup("warm-up", TOKENS) == 4 * CHUNK  # starts the scheduler's heartbeat
    engine.call("scheduler", "end_session", "warm-up")
    lookups_before = stats(server.url)["lookups"]
    server.proc.send_signal(signal.SIGSTOP)
    try:
        assert engine.lookup("late", TOKENS) == 0  # timed out: the engine computes
        time.sleep(1.0)
    finally:
        server.proc.send_signal(signal.SIGCONT)
    # The server runs the lookup it received and locks 4 chunks; the client, once the
    # server answers again, ends that session, long before the 300 s lock TTL.
    deadline = time.monotonic() + HANG_GUARD
    while (now := stats(server.url))["lookups"] == lookups_before or now["locked_chunks"]:
        locked = now["locked_chunks"]
        assert time.monotonic() < deadline, f"{locked} chunks stay locked"
        time.sleep(0.1)
    assert engine.lookup("fresh", TOKENS) == 4 * CHUNK
