"""A seeded protocol fuzzer: whatever arrives, the server answers or drops it in bounded
time and stays healthy, with bounded memory.

Every request type is sent valid, with fields mutated (wrong types, huge or negative
numbers, long strings and byte strings, missing and extra fields), as random bytes,
truncated, past its size bound, under unknown types and with wrong frame counts. A
message with a readable header must be answered under its call id; one without is
dropped. Afterwards a normal engine registers, stores, looks up and retrieves byte-exact.
"""

import os
import random
import time

import msgspec
import torch

from kvdepot.protocol import (
    MAX_BLOCK_REPORT_BYTES,
    MAX_MESSAGE_BYTES,
    REQUEST_HEADER,
    BlockAllocation,
    EndSession,
    FreeLookupLocks,
    KeyScope,
    LayerSpec,
    Lookup,
    QueryPrefetchStatus,
    RegisterKVCache,
    ReportBlockAllocation,
    RequestType,
    Retrieve,
    SharedCPUMemory,
    Store,
    TakeBlockEvents,
    UnregisterKVCache,
    pack_ints,
)
from tests.support.raw import RawSocket, memory_kib

SEED = 20261201
BUDGET_S = 40.0
"""The fuzzing loop stops after this long (the whole test stays near a minute)."""
MAX_MESSAGES = 30_000
REPLY_TIMEOUT = 10.0
"""A hang guard: the server answers in milliseconds."""
CHUNK = 64


def valid_messages(rng: random.Random) -> dict[RequestType, object]:
    tokens = pack_ints([rng.randrange(50_000) for _ in range(rng.choice((0, 63, 200)))])
    request_id = f"fuzz-{rng.randrange(1000)}"
    # vLLM block hashes (16-token blocks): the right count and size, or not.
    hashes = rng.randbytes(rng.choice((0, 32 * 4, 32 * 12, 31, 33 * 4)))
    # A tail, or none; of a length that fits the range, or not.
    tail = rng.choice((0, 0, 16, 40, CHUNK, CHUNK + 8))
    transfer = dict(instance_id=rng.randbytes(16), request_id=request_id,
                    token_ids=tokens, start=0, end=CHUNK + tail % CHUNK,
                    block_ids=pack_ints([0, 1, 2, 3, 4, 5, 6]))
    layer = LayerSpec(name="l", allocation=0, dtype="bfloat16", shape=[8, 2, 16, 64],
                      strides=[2048, 1024, 64, 1], storage_offset=0, block_axis=0)
    return {
        RequestType.GET_CHUNK_SIZE: b"\x90",
        RequestType.PING: b"\x90",
        RequestType.LOOKUP: Lookup(request_id, KeyScope("fuzz-model", 1, ""), tokens, 1,
                                   block_hashes=hashes, hash_block_size=16,
                                   hashes_first_chunk=rng.choice((0, 1, 3)),
                                   tails=rng.random() < 0.5),
        RequestType.QUERY_PREFETCH_STATUS: QueryPrefetchStatus(request_id),
        RequestType.FREE_LOOKUP_LOCKS: FreeLookupLocks(request_id, 0, CHUNK),
        RequestType.END_SESSION: EndSession(request_id),
        RequestType.REPORT_BLOCK_ALLOCATION: ReportBlockAllocation(
            os.getpid(), "fuzz-model",
            [BlockAllocation(request_id, pack_ints([1, 2]), pack_ints([3, 4]))]),
        RequestType.REGISTER_KV_CACHE: RegisterKVCache(
            model="fuzz-model", world_size=1, rank=0, block_size=16,
            allocations=[SharedCPUMemory(fd_index=0, nbytes=1 << 16)], layers=[layer],
            engine_pid=os.getpid(), handover_ticket=rng.randbytes(16)),
        RequestType.UNREGISTER_KV_CACHE: UnregisterKVCache(rng.randbytes(16)),
        RequestType.STORE: Store(**transfer, block_hashes=hashes, hash_block_size=16,
                                 tail_tokens=tail),
        RequestType.RETRIEVE: Retrieve(**transfer, tail_tokens=tail),
        RequestType.CLEAR: b"\x90",
        RequestType.STATS: b"\x90",
        RequestType.TAKE_BLOCK_EVENTS: TakeBlockEvents(rng.randrange(-1, 1000)),
    }


def random_value(rng: random.Random) -> object:
    return rng.choice([
        lambda: rng.choice((-1, 0, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1)),
        lambda: rng.randrange(-1000, 1000),
        lambda: "x" * rng.choice((0, 1, 300, 5000, 70_000)),
        lambda: rng.randbytes(rng.choice((0, 3, 64, 4097, 70_000))),
        lambda: None, lambda: True, lambda: 1.5, lambda: {"k": 1},
        lambda: [rng.randrange(100) for _ in range(rng.choice((0, 3, 20)))],
        lambda: [["cpu", rng.randrange(10), rng.randrange(10)]],
    ])()


def mutate(rng: random.Random, request_type: RequestType, message: object) -> bytes:
    body = message if isinstance(message, bytes) else msgspec.msgpack.encode(message)
    fields = msgspec.msgpack.decode(body)
    kind = rng.randrange(8)
    if kind == 0 or not isinstance(fields, list):
        return body
    if kind == 1 and fields:  # one field replaced
        fields[rng.randrange(len(fields))] = random_value(rng)
    elif kind == 2 and fields:  # a nested field replaced (not a registration's memory)
        nested = [i for i, f in enumerate(fields) if isinstance(f, list) and f
                  and not (request_type is RequestType.REGISTER_KV_CACHE and i == 5)]
        if nested:
            inner = fields[rng.choice(nested)]
            inner[rng.randrange(len(inner))] = random_value(rng)
    elif kind == 3:
        del fields[rng.randrange(len(fields) + 1):]
    elif kind == 4:
        fields.extend(random_value(rng) for _ in range(rng.randrange(1, 4)))
    elif kind == 5:
        return rng.randbytes(rng.randrange(0, 300))
    elif kind == 6:
        return body[:rng.randrange(len(body) + 1)]
    else:
        return msgspec.msgpack.encode(random_value(rng))
    return msgspec.msgpack.encode(fields)


def frames_for(rng: random.Random, call_id: int, messages: dict, sent_types: set
               ) -> tuple[list[bytes], bool]:
    """A message to send and whether it must be answered (it has a readable header)."""
    shape = rng.random()
    request_type = rng.choice(list(messages))
    header = REQUEST_HEADER.pack(call_id, request_type)
    if shape < 0.80:
        sent_types.add(request_type)
        return [header, mutate(rng, request_type, messages[request_type])], True
    if shape < 0.86:
        unknown = rng.choice((0, 14, 200, 65535))
        return [REQUEST_HEADER.pack(call_id, unknown), b"\x90"], True
    if shape < 0.93:
        count = rng.choice((0, 2, 3, 5))
        return [header, *(rng.randbytes(rng.randrange(20)) for _ in range(count))], True
    if shape < 0.96:
        big = msgspec.msgpack.encode([os.getpid(), "m", [["r", b"", b"x" * 1000]] * 1100])
        assert len(big) > MAX_BLOCK_REPORT_BYTES
        return [REQUEST_HEADER.pack(call_id, RequestType.REPORT_BLOCK_ALLOCATION), big], True
    length = rng.choice((0, 1, 5, 7, 12))
    return [rng.randbytes(length), *(b"" for _ in range(rng.randrange(3)))], False


def test_fuzzed_requests_are_answered_or_dropped_and_the_server_stays_healthy(server, engines):
    rng = random.Random(SEED)
    pid = server.proc.pid
    raw = RawSocket(server.url)
    rss_before = memory_kib(pid)
    started = time.monotonic()
    sent = answered = dropped = 0
    call_id = 0
    sent_types: set[RequestType] = set()
    while sent < MAX_MESSAGES and time.monotonic() - started < BUDGET_S:
        call_id += 1
        frames, expect_reply = frames_for(rng, call_id, valid_messages(rng), sent_types)
        raw.send_frames(frames)
        sent += 1
        if not expect_reply:
            dropped += 1
            continue
        got = raw.reply(REPLY_TIMEOUT)
        assert got is not None, f"message {call_id} ({[f[:20] for f in frames]}) got no reply"
        assert got[0] == call_id, f"reply to {got[0]} while waiting for {call_id}"
        answered += 1
    # A frame past the message size bound: ZeroMQ drops the sender, the server goes on.
    huge = RawSocket(server.url)
    huge.send_frames([REQUEST_HEADER.pack(1, RequestType.PING), b"\0" * (MAX_MESSAGE_BYTES + 1)])
    assert huge.reply(1.0) is None
    huge.close()
    print(f"fuzzer: {sent} messages, {answered} answered, {dropped} dropped, "
          f"{time.monotonic() - started:.1f} s")
    assert answered > 100 and sent_types == set(RequestType)

    # Healthy afterwards: a normal engine gets byte-exact round trips.
    status, _ = raw.call(RequestType.PING, b"\x90")
    assert status == 0
    raw.close()
    engine = engines()
    engine.fill(seed=99)
    tokens = list(range(100, 100 + 2 * CHUNK + 1))
    engine.store("after-fuzz", tokens, list(range(8)), 0, 2 * CHUNK)
    expected = engine.read_blocks(list(range(8)))
    assert engine.lookup("after-fuzz-load", tokens) == 2 * CHUNK
    assert engine.retrieve("after-fuzz-load", tokens, list(range(16, 24)), 0, 2 * CHUNK) == set()
    for a, b in zip(expected, engine.read_blocks(list(range(16, 24))), strict=True):
        assert torch.equal(a, b)
    growth_mib = (memory_kib(pid) - rss_before) / 1024
    print(f"fuzzer: server RSS grew {growth_mib:.0f} MiB")
    assert growth_mib < 128
