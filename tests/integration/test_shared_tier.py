"""The shared tier (issue 10): two `kvdepot serve` nodes with separate CPU memory and one
Redis (standalone or a 3-master cluster with replicas). What node A's engine stores is
a byte-exact hit on node B; failures of the Redis side never fail a request or serve a
wrong byte; tenants and salts stay apart across nodes; damaged values are misses."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import numpy as np
import pytest
import torch

from kvdepot.keys import chain_hashes, rank_key, scope_root
from kvdepot.protocol import TOKEN_DTYPE, KeyScope
from kvdepot.storage.shared import value as shared_value
from kvdepot.testbed.server_process import ServerProcess
from tests.support.credentials import credential_file
from tests.support.engine import EngineProcess
from tests.support.layouts import LAYOUTS
from tests.support.server import free_port, lookup_answered_later, small_server
from tests.support.waiting import wait_until

CHUNK = 64
BLOCK = 16
PIECE = "8KiB"
"""Smaller than a test chunk, so every chunk is several pieces (over several shards)."""


def prompt(seed: int, chunks: int = 3) -> list[int]:
    return [seed * 10_000 + i for i in range(chunks * CHUNK + 1)]


def blocks_of(chunks: int, first: int = 0) -> list[int]:
    return list(range(first, first + chunks * CHUNK // BLOCK))


def node(redis_url: str, *extra: str, **options) -> ServerProcess:
    return small_server(chunk_size=CHUNK, extra=("--remote", redis_url, "--remote-piece-size",
                                                 PIECE, "--remote-timeout", "0.5", *extra),
                        **options).start()


def stats(server: ServerProcess) -> dict[str, float]:
    return server.stats()


def wait_written(server: ServerProcess, chunks: int) -> None:
    """Until `chunks` chunks reached the shared tier's writer and were settled (written,
    found present, or dropped)."""
    def settled() -> bool:
        s = stats(server)
        return (s["remote_written_chunks"] + s["remote_present_chunks"]
                + s["remote_dropped_writes"]) >= chunks
    wait_until(settled, f"{chunks} chunks written behind")


def chunk_key(tokens: list[int], index: int, salt: str = "") -> bytes:
    root = scope_root(KeyScope("test-model", 1, salt))
    hashes = chain_hashes(root, np.asarray(tokens, dtype=TOKEN_DTYPE), CHUNK, index + 1)
    return rank_key(hashes[index], 0)


def assert_same(expected: list[torch.Tensor], actual: list[torch.Tensor]) -> None:
    for a, b in zip(expected, actual, strict=True):
        assert torch.equal(a, b)


@pytest.fixture
def nodes() -> Iterator[Callable[..., ServerProcess]]:
    with ExitStack() as stack:
        def start(redis_url: str, *extra: str, **options) -> ServerProcess:
            server = node(redis_url, *extra, **options)
            stack.callback(server.stop)
            return server
        yield start


def store_on_a_load_on_b(a: EngineProcess, b: EngineProcess, server_a: ServerProcess,
                         seed: int, salt: str = "") -> None:
    tokens = prompt(seed)
    a.fill(seed=seed)
    a.store(f"store-{seed}", tokens, blocks_of(3), 0, 3 * CHUNK, salt=salt)
    expected = a.read_blocks(blocks_of(3))
    wait_written(server_a, stats(server_a)["stored_chunks"])
    assert b.lookup(f"load-{seed}", tokens, salt=salt) == 3 * CHUNK
    b.write_through_old_view(0.0)
    assert b.retrieve(f"load-{seed}", tokens, blocks_of(3, 16), 0, 3 * CHUNK, salt=salt) == set()
    assert_same(expected, b.read_blocks(blocks_of(3, 16)))


# ---- hits across nodes ------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunks_stored_on_node_a_are_byte_exact_hits_on_node_b(layout, shared_redis_cluster,
                                                                nodes, engines_at):
    redis_cluster = shared_redis_cluster
    server_a, server_b = nodes(redis_cluster.url), nodes(redis_cluster.url)
    a = engines_at(server_a.url, layout=layout, block_size=BLOCK)
    b = engines_at(server_b.url, layout=layout, block_size=BLOCK)
    started = time.monotonic()
    store_on_a_load_on_b(a, b, server_a, seed=1)
    elapsed = time.monotonic() - started
    s = stats(server_b)
    assert s["remote_read_chunks"] == 3 and s["promoted_chunks"] == 3
    assert s["remote_discarded_chunks"] == 0
    # The time B's read took, within the time the whole exchange took; A read nothing.
    assert 0 < s["remote_read_seconds"] < elapsed
    assert stats(server_a)["remote_read_seconds"] == 0
    # Every chunk is several pieces, and every shard holds its share of them, give or
    # take one.
    with redis_cluster.client() as cluster:
        head = shared_value.decode_head(cluster.get(shared_value.head_key(
            chunk_key(prompt(1), 0))))
        assert head is not None and head.pieces > 1
        held = Counter(cluster.get_node_from_key(name).port
                       for name in shared_value.piece_keys(chunk_key(prompt(1), 0), head.pieces))
        masters = len(cluster.get_primaries())
        assert len(held) == min(masters, head.pieces)
        assert max(held.values()) == -(-head.pieces // masters)
    # Node B stores the same prefix: the cluster has it, nothing is written again.
    b.store("again", prompt(1), blocks_of(3, 16), 0, 3 * CHUNK)
    assert stats(server_b)["store_present_chunks"] == 3  # CPU memory has it since the load


def test_a_standalone_server_and_write_skipping(redis_server, nodes, engines_at):
    url = f"redis://{redis_server.address}"
    server_a, server_b = nodes(url), nodes(url)
    a, b = engines_at(server_a.url), engines_at(server_b.url)
    store_on_a_load_on_b(a, b, server_a, seed=2)
    # Node B's own engine stores the same document after computing it: nothing to write.
    b.fill(seed=2)
    b.call("scheduler", "end_session", "load-2")
    assert server_b.clear() == 3
    b.store("b-store", prompt(2), blocks_of(3), 0, 3 * CHUNK)
    wait_written(server_b, 3)
    s = stats(server_b)
    assert s["remote_present_chunks"] == 3 and s["remote_written_chunks"] == 0
    with redis_server.client() as r:
        assert 0 < r.ttl(shared_value.head_key(chunk_key(prompt(2), 0))) <= 86400


# ---- failures -----------------------------------------------------------------------------
def check_every_request(a: EngineProcess, b: EngineProcess, server_a: ServerProcess,
                        seed: int) -> int:
    """Store a document on A, load whatever B finds of it: every request succeeds and
    every loaded byte is A's. Returns the tokens B loaded."""
    tokens = prompt(seed)
    a.fill(seed=seed)
    a.store(f"store-{seed}", tokens, blocks_of(3), 0, 3 * CHUNK)
    expected = a.read_blocks(blocks_of(3))
    assert a.lookup(f"local-{seed}", tokens) == 3 * CHUNK  # node A's CPU memory
    a.call("scheduler", "end_session", f"local-{seed}")
    wait_written(server_a, stats(server_a)["stored_chunks"])
    hit = b.lookup(f"load-{seed}", tokens)
    if hit:
        b.write_through_old_view(0.0)
        assert b.retrieve(f"load-{seed}", tokens, blocks_of(3, 16), 0, hit) == set()
        blocks = hit // BLOCK
        for want, got in zip(expected, b.read_blocks(blocks_of(3, 16)), strict=True):
            assert torch.equal(want[:blocks], got[:blocks])
    b.call("scheduler", "end_session", f"load-{seed}")
    return hit


def test_a_master_killed_mid_run_fails_no_request(redis_cluster, nodes, engines_at):
    server_a, server_b = nodes(redis_cluster.url), nodes(redis_cluster.url)
    a, b = engines_at(server_a.url), engines_at(server_b.url)
    assert check_every_request(a, b, server_a, seed=10) == 3 * CHUNK
    victim = redis_cluster.master_of(shared_value.head_key(chunk_key(prompt(11), 0)))
    victim.kill()
    for seed in range(11, 16):  # while the replica takes over
        check_every_request(a, b, server_a, seed)
    redis_cluster.wait_healthy()
    wait_until(lambda: stats(server_a)["remote_available"] == 1
               and stats(server_b)["remote_available"] == 1, "reconnection")
    assert check_every_request(a, b, server_a, seed=20) == 3 * CHUNK
    for server in (server_a, server_b):
        s = stats(server)
        assert s["retrieve_errors"] == 0 and s["store_errors"] == 0


def test_the_whole_cluster_stopped_and_restarted(redis_cluster, nodes, engines_at):
    server_a, server_b = nodes(redis_cluster.url), nodes(redis_cluster.url)
    a, b = engines_at(server_a.url), engines_at(server_b.url)
    assert check_every_request(a, b, server_a, seed=30) == 3 * CHUNK
    redis_cluster.stop()
    assert check_every_request(a, b, server_a, seed=31) == 0  # B has nowhere to find it
    assert stats(server_b)["remote_available"] == 0
    # B's own CPU memory still answers at once.
    assert b.lookup("local", prompt(30)) == 3 * CHUNK
    b.call("scheduler", "end_session", "local")
    redis_cluster.restart()
    wait_until(lambda: stats(server_a)["remote_available"] == 1
               and stats(server_b)["remote_available"] == 1, "reconnection")
    assert check_every_request(a, b, server_a, seed=32) == 3 * CHUNK
    for server in (server_a, server_b):
        s = stats(server)
        assert s["retrieve_errors"] == 0 and s["store_errors"] == 0
        assert s["remote_breaker_opens"] >= 1


def test_redis_down_lookups_answer_from_local_tiers(redis_server, nodes, engines_at):
    url = f"redis://{redis_server.address}"
    server_a, server_b = nodes(url), nodes(url)
    a, b = engines_at(server_a.url), engines_at(server_b.url)
    store_on_a_load_on_b(a, b, server_a, seed=40)
    redis_server.kill()
    assert a.lookup("a-local", prompt(40)) == 3 * CHUNK
    assert b.lookup("b-local", prompt(40)) == 3 * CHUNK  # promoted into B's CPU memory before
    assert b.lookup("b-miss", prompt(41)) == 0
    s = stats(server_b)
    assert s["remote_available"] == 0 and s["remote_breaker_opens"] == 1
    a.fill(seed=42)
    a.store("while-down", prompt(42), blocks_of(3), 0, 3 * CHUNK)  # dropped, not queued
    wait_until(lambda: stats(server_a)["remote_dropped_writes"] >= 3, "dropped writes")
    redis_server.start()
    wait_until(lambda: stats(server_b)["remote_available"] == 1
               and stats(server_a)["remote_available"] == 1, "reconnection")
    a.call("scheduler", "end_session", "a-local")
    b.call("scheduler", "end_session", "b-local")
    store_on_a_load_on_b(a, b, server_a, seed=43)


def test_a_node_starts_while_redis_is_down(redis_server, nodes, engines_at):
    url = f"redis://{redis_server.address}"
    redis_server.stop()
    server = nodes(url)
    assert stats(server)["remote_available"] == 0
    engine = engines_at(server.url)
    engine.fill(seed=50)
    engine.store("s", prompt(50), blocks_of(3), 0, 3 * CHUNK)
    assert engine.lookup("l", prompt(50)) == 3 * CHUNK
    redis_server.start()
    wait_until(lambda: stats(server)["remote_available"] == 1, "reconnection")


# ---- isolation ------------------------------------------------------------------------------
def test_salts_and_tenants_stay_apart_across_nodes(state_dir, redis_server, nodes, engines_at):
    url = f"redis://{redis_server.address}"
    server_a, server_b = nodes(url), nodes(url)
    cred = {name: credential_file(state_dir, name, "engine", tenant)
            for name, tenant in (("alice-a", "alpha"), ("alice-b", "alpha"), ("bob-b", "beta"))}
    alpha_a = engines_at(server_a.url, credentials=cred["alice-a"])
    alpha_b = engines_at(server_b.url, credentials=cred["alice-b"])
    beta_b = engines_at(server_b.url, credentials=cred["bob-b"])
    owner_b = engines_at(server_b.url)
    alpha_a.fill(seed=60)
    tokens = prompt(60)
    alpha_a.store("s", tokens, blocks_of(3), 0, 3 * CHUNK, salt="salt-1")
    wait_written(server_a, 3)
    assert beta_b.lookup("beta", tokens, salt="salt-1") == 0
    assert owner_b.lookup("owner", tokens, salt="salt-1") == 0
    assert alpha_b.lookup("other-salt", tokens, salt="salt-2") == 0
    assert alpha_b.lookup("alpha", tokens, salt="salt-1") == 3 * CHUNK
    assert stats(server_b)["remote_read_chunks"] == 3


# ---- damaged values --------------------------------------------------------------------------
def _pieces(r, key: bytes) -> list[str]:
    """The keys of a stored chunk's pieces (their names depend on the head's piece
    count)."""
    return shared_value.piece_keys(key, shared_value.decode_head(
        r.get(shared_value.head_key(key))).pieces)


def _flip_piece_byte(r, key: bytes) -> None:
    name = _pieces(r, key)[0]
    data = bytearray(r.get(name))
    data[10] ^= 0x01
    r.set(name, bytes(data))


def _shorten_piece(r, key: bytes) -> None:
    name = _pieces(r, key)[0]
    r.set(name, r.get(name)[:-100])


def _delete_piece(r, key: bytes) -> None:
    r.delete(_pieces(r, key)[-1])


def _other_format(r, key: bytes) -> None:
    head = bytearray(r.get(shared_value.head_key(key)))
    head[4] = shared_value.FORMAT + 1
    r.set(shared_value.head_key(key), bytes(head))


def _other_layout_fingerprint(r, key: bytes) -> None:
    head = bytearray(r.get(shared_value.head_key(key)))
    head[-1] ^= 0x80
    r.set(shared_value.head_key(key), bytes(head))


def _another_chunks_value(r, key: bytes) -> None:
    """The value of chunk 2, copied under chunk 1's keys (same length and layout)."""
    other = chunk_key(prompt(70), 2)
    head = shared_value.decode_head(r.get(shared_value.head_key(other)))
    for src, dst in zip(shared_value.piece_keys(other, head.pieces),
                        shared_value.piece_keys(key, head.pieces), strict=True):
        r.set(dst, r.get(src))
    r.set(shared_value.head_key(key), r.get(shared_value.head_key(other)))


DAMAGE = {"flipped_byte": _flip_piece_byte, "short_piece": _shorten_piece,
          "missing_piece": _delete_piece, "other_format": _other_format,
          "other_layout_fingerprint": _other_layout_fingerprint,
          "another_chunks_value": _another_chunks_value}


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_value_is_a_miss_deleted_and_counted(how, redis_server, nodes, engines_at):
    url = f"redis://{redis_server.address}"
    server_a, server_b = nodes(url), nodes(url)
    a, b = engines_at(server_a.url), engines_at(server_b.url)
    a.fill(seed=70)
    tokens = prompt(70)
    a.store("s", tokens, blocks_of(3), 0, 3 * CHUNK)
    expected = a.read_blocks(blocks_of(1))
    wait_written(server_a, 3)
    damaged = chunk_key(tokens, 1)
    with redis_server.client() as r:
        DAMAGE[how](r, damaged)
        # Only the chunk before the damaged one is promised, and it loads byte-exact.
        assert b.lookup("r", tokens) == CHUNK
        b.write_through_old_view(0.0)
        assert b.retrieve("r", tokens, blocks_of(1, 16), 0, CHUNK) == set()
        assert_same(expected, b.read_blocks(blocks_of(1, 16)))
        assert r.get(shared_value.head_key(damaged)) is None
    assert stats(server_b)["remote_discarded_chunks"] == 1
    assert b.lookup("again", tokens) == CHUNK
    assert stats(server_b)["remote_discarded_chunks"] == 1


# ---- secrets ---------------------------------------------------------------------------------
def test_the_password_comes_from_a_file_never_the_command_line(tmp_path, nodes, engines_at):
    from tests.support.redis_servers import RedisProcess, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    redis = RedisProcess(tmp_path / "redis", password="s3cret-pw").start()
    try:
        url = f"redis://{redis.address}"
        refused = subprocess.run(
            [sys.executable, "-m", "kvdepot.cli", "serve", "--port", str(free_port()), "--remote",
             f"redis://default:s3cret-pw@{redis.address}"], capture_output=True, text=True,
            timeout=120)
        assert refused.returncode == 2 and "password on the command line" in refused.stderr
        secret = tmp_path / "redis-password"
        secret.write_text("s3cret-pw\n")
        secret.chmod(0o600)
        server_a = nodes(url, "--remote-password-file", str(secret))
        server_b = nodes(url, env={"KVDEPOT_REMOTE_PASSWORD": "s3cret-pw"})
        wrong = nodes(url, env={"KVDEPOT_REMOTE_PASSWORD": "wrong"})
        assert stats(wrong)["remote_available"] == 0
        a, b = engines_at(server_a.url), engines_at(server_b.url)
        store_on_a_load_on_b(a, b, server_a, seed=80)
    finally:
        redis.stop()


def test_tls_with_a_private_ca(tmp_path, nodes, engines_at):
    import shutil

    from tests.support.redis_servers import RedisProcess, make_test_ca, redis_server_binary

    if redis_server_binary() is None or shutil.which("openssl") is None:
        pytest.skip("redis-server or openssl is not installed")
    ca = make_test_ca(tmp_path / "tls")
    redis = RedisProcess(tmp_path / "redis", tls=ca).start()
    try:
        url = f"rediss://{redis.address}"
        server_a = nodes(url, "--remote-ca-file", str(ca / "ca.crt"))
        server_b = nodes(url, "--remote-ca-file", str(ca / "ca.crt"))
        # Without the CA the certificate is refused: the tier stays closed, nothing is read.
        untrusting = nodes(url)
        assert stats(untrusting)["remote_available"] == 0
        a, b = engines_at(server_a.url), engines_at(server_b.url)
        store_on_a_load_on_b(a, b, server_a, seed=90)
    finally:
        redis.stop()


def test_a_lookup_answers_none_while_the_shared_tier_is_read(redis_server, nodes, engines_at):
    from kvdepot.rpc.connection import DepotConnection

    url = f"redis://{redis_server.address}"
    server_a, server_b = nodes(url), nodes(url)
    a = engines_at(server_a.url)
    a.fill(seed=95)
    a.store("s", prompt(95), blocks_of(3), 0, 3 * CHUNK)
    wait_written(server_a, 3)
    conn = DepotConnection(server_b.url)
    try:
        assert lookup_answered_later(conn, "raw", prompt(95)) == 3
    finally:
        conn.close()
