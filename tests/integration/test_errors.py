"""Every error path: a clear error at once, never a hang, never a byte outside the blocks."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import zmq

from kvdepot.errors import (
    ChunkMissing,
    InvalidRequest,
    MalformedPayload,
    NotRegistered,
    ServerUnavailable,
    UnknownRequestType,
)
from kvdepot.integrations.vllm.mp_adapter import LMCacheMPSchedulerAdapter
from kvdepot.protocol import (
    REPLY_HEADER,
    REQUEST_HEADER,
    KeyScope,
    Lookup,
    RequestType,
    SharedCPUMemory,
    Store,
    pack_ints,
)
from kvdepot.rpc.connection import DepotConnection
from kvdepot.rpc.credentials import find_credential
from tests.support.engine import EngineError
from tests.support.raw_registration import FENCE, hand_over_memory, register
from tests.support.server import free_port

CHUNK = 64
TOKENS = list(range(300, 300 + 4 * CHUNK + 1))
NO_WAIT = 300.0  # generous: an error must arrive at once, never by timing out
"""The fence of the registrations these tests make by hand."""


@pytest.fixture
def conn(server):
    c = DepotConnection(server.url)
    yield c
    c.close()


def test_unknown_request_type_is_an_immediate_error(server):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    find_credential(server.url).apply(sock, server.url)  # the owner's, as every client finds it
    sock.connect(server.url)
    sock.send_multipart([REQUEST_HEADER.pack(7, 99), b""])
    assert sock.poll(10_000), "no reply to an unknown request type"
    header, payload = sock.recv_multipart()
    call_id, status = REPLY_HEADER.unpack(header)
    assert call_id == 7 and status == UnknownRequestType.kind
    assert b"unknown request type 99" in payload
    sock.close(linger=0)


def test_malformed_payload_is_an_immediate_error(conn):
    future = conn.submit(RequestType.LOOKUP)  # an empty struct where a Lookup belongs
    with pytest.raises(MalformedPayload, match="malformed LOOKUP payload"):
        future.result(NO_WAIT)
    odd = Lookup("r", KeyScope("m", 1), b"\x01\x02\x03", 1)
    with pytest.raises(MalformedPayload, match="not a multiple of 4"):
        conn.submit(RequestType.LOOKUP, odd).result(NO_WAIT)


def test_bad_cache_salt_raises_the_servers_message(server):
    scheduler = LMCacheMPSchedulerAdapter(server.url, zmq.Context.instance(), "m",
                                          vllm_block_size=16, mq_timeout=NO_WAIT)
    with pytest.raises(InvalidRequest, match="cache_salt must consist of printable") as bad:
        scheduler.maybe_submit_lookup_request("r", TOKENS, cache_salt="secret\nsalt")
    assert "index 6" in str(bad.value) and "secret" not in str(bad.value)  # salts are secrets
    with pytest.raises(InvalidRequest, match=r"cache_salt: .* <= 512"):
        scheduler.maybe_submit_lookup_request("r2", TOKENS, cache_salt="x" * 600)
    scheduler.shutdown()


def test_bad_readers_count_is_rejected(conn):
    with pytest.raises(InvalidRequest, match="readers_per_key"):
        conn.submit(RequestType.LOOKUP,
                    Lookup("r", KeyScope("m", 1), pack_ints(TOKENS), 0)).result(NO_WAIT)


def test_store_for_an_unregistered_instance(conn):
    store = Store(instance_id=bytes(16), request_id="r", token_ids=pack_ints(TOKENS), start=0,
                  end=CHUNK, block_ids=pack_ints([0, 1, 2, 3]))
    with pytest.raises(NotRegistered, match="register_kv_caches must come first"):
        conn.submit(RequestType.STORE, store).result(NO_WAIT)


def test_registration_the_server_cannot_map_fails_clearly(conn):
    request, _ = hand_over_memory(conn, {"l0": torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)})
    request.allocations = [SharedCPUMemory(fd_index=3, nbytes=4096)]
    with pytest.raises(InvalidRequest, match="fd_index 3 is outside the 2 file descriptors"):
        conn.submit(RequestType.REGISTER_KV_CACHE, request).result(NO_WAIT)
    request, _ = hand_over_memory(conn, {"l0": torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)})
    request.allocations = [SharedCPUMemory(fd_index=0, nbytes=1 << 30)]
    with pytest.raises(InvalidRequest, match="fewer than the 1073741824 registered"):
        conn.submit(RequestType.REGISTER_KV_CACHE, request).result(NO_WAIT)
    request, _ = hand_over_memory(conn, {"l0": torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)})
    request.world_size, request.rank = 2, 2
    with pytest.raises(InvalidRequest, match="outside world size"):
        conn.submit(RequestType.REGISTER_KV_CACHE, request).result(NO_WAIT)
    request, _ = hand_over_memory(conn, {"l0": torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)})
    request.fence = None
    with pytest.raises(InvalidRequest, match="must carry its fence"):
        conn.submit(RequestType.REGISTER_KV_CACHE, request).result(NO_WAIT)


def test_block_size_that_does_not_divide_the_chunk_is_refused(engines):
    with pytest.raises(EngineError, match="not a multiple of the engine block size 48"):
        engines(block_size=48)


@pytest.mark.parametrize("case", ["out_of_range", "negative", "short_list", "unaligned_start",
                                  "past_tokens"])
def test_bad_stores_write_nothing(engines, server, case):
    engine = engines(num_blocks=32)
    blocks, start, end, tokens = list(range(8)), 0, 2 * CHUNK, TOKENS
    if case == "out_of_range":
        blocks = [0, 1, 2, 3, 4, 5, 6, 32]
    elif case == "negative":
        blocks = [0, 1, 2, 3, 4, 5, 6, -1]
    elif case == "short_list":
        blocks = blocks[:7]
    elif case == "unaligned_start":
        start = 16
    else:
        tokens = TOKENS[:CHUNK + 10]
    engine.store("bad", tokens, blocks, start, end)  # reported finished, error logged
    from kvdepot.client.admin import AdminClient

    with AdminClient(server.url) as admin:
        stats = admin.stats()
    assert stats["chunks"] == 0 and stats["store_errors"] == 1
    assert engine.lookup("r", TOKENS) == 0


@pytest.mark.parametrize("case", ["out_of_range", "short_list", "unaligned_skip", "missing"])
def test_bad_retrieves_are_load_errors_and_write_nothing(engines, case):
    engine = engines(num_blocks=32)
    engine.fill(seed=3)
    engine.store("w", TOKENS, list(range(8)), 0, 2 * CHUNK)
    target = list(range(16, 24))
    engine.write_through_old_view(0.0)
    skip, tokens = 0, TOKENS
    if case == "out_of_range":
        target = [16, 17, 18, 19, 20, 21, 22, 99]
    elif case == "short_list":
        target = target[:7]
    elif case == "unaligned_skip":
        skip = 8
    else:
        tokens = [1, *TOKENS[1:]]
    errors = engine.retrieve("r", tokens, target, 0, 2 * CHUNK, skip=skip)
    assert errors == set(target)
    assert all(bool((t == 0).all()) for t in engine.read_blocks(list(range(32))))


def test_layout_mismatch_is_a_load_error(engines):
    writer = engines(layout="flash_attn")
    reader = engines(layout="flash_infer")
    writer.fill(seed=4)
    writer.store("w", TOKENS, list(range(4)), 0, CHUNK)
    assert reader.lookup("r", TOKENS) == CHUNK  # same model and tokens: same keys
    assert reader.retrieve("r", TOKENS, list(range(4, 8)), 0, CHUNK) == {4, 5, 6, 7}
    assert all(bool((t == 0).all()) for t in reader.read_blocks(list(range(8))))


def test_missing_chunk_error_names_the_chunk(conn, server):
    instance_id = register(conn, {"l0": torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)})
    slot, generation = FENCE.begin()
    from kvdepot.protocol import Retrieve

    with pytest.raises(ChunkMissing, match=r"chunk 0 .* is not in the cache"):
        conn.submit(RequestType.RETRIEVE, Retrieve(
            instance_id=instance_id, request_id="r", token_ids=pack_ints(TOKENS), start=0,
            end=CHUNK, block_ids=pack_ints([0, 1, 2, 3]), fence_slot=slot,
            fence_generation=generation)).result(NO_WAIT)


def test_connecting_to_no_server_fails_fast_naming_the_url():
    url = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnavailable, match=url.replace(".", r"\.")):
        LMCacheMPSchedulerAdapter(url, zmq.Context.instance(), "m", mq_timeout=NO_WAIT)


def test_serve_refuses_a_taken_port(server):
    result = subprocess.run([sys.executable, "-m", "kvdepot.cli", "serve", "--port",
                             str(server.port), "--l1-size", "64MiB"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "already in use" in result.stderr


def test_a_slow_store_does_not_delay_pings(conn, server):
    # A large store (many chunks, one registration) is in flight while a ping is answered.
    nblocks = 4096
    kv = torch.ones(nblocks, 8, 16, 128, dtype=torch.bfloat16)  # 256 MiB
    instance_id = register(conn, {"l0": kv})
    tokens = np.arange(nblocks * 16, dtype=np.int32)
    slot, generation = FENCE.begin()
    store = conn.submit(RequestType.STORE, Store(
        instance_id=instance_id, request_id="big", token_ids=pack_ints(tokens), start=0,
        end=nblocks * 16, block_ids=pack_ints(np.arange(nblocks)), fence_slot=slot,
        fence_generation=generation))
    ping = conn.submit(RequestType.PING)
    ping.result(NO_WAIT)
    assert not store.done(), "the ping waited for the store"
    store.result(NO_WAIT)


def test_prometheus_metrics_are_served():
    import urllib.request

    from tests.support.server import running_server

    port = free_port()
    with running_server(extra=("--metrics-port", str(port))):
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
    text = body.decode()
    assert "kvdepot_capacity_bytes 2.68435456e+08" in text
    assert "kvdepot_lookups_total 0.0" in text


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_serve_logs_where_it_listens_and_stops_cleanly_on_signals(signame):
    import signal

    from tests.support.server import small_server

    server = small_server(l1_size="64MiB").start()
    server.proc.send_signal(getattr(signal, signame))
    log = server.stop()
    assert server.proc.returncode == 0
    assert f"kvdepot listening on {server.url}: chunk size 64 tokens, 64.0 MiB" in log
    assert "kvdepot stopped" in log
