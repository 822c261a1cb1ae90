"""Issue 12, item 6: SIGTERM drains. Transfers already submitted finish, nothing new
starts, what was stored is written behind to disk, and the server exits 0 within its
drain timeout. Then a server restarted on the same disk serves every store the first
one acknowledged, byte for byte.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
import torch

from kvdepot.client.admin import AdminClient
from kvdepot.errors import InvalidRequest, ServerUnavailable
from kvdepot.protocol import (
    KeyScope,
    Lookup,
    QueryPrefetchStatus,
    RequestType,
    Retrieve,
    Store,
    pack_ints,
)
from kvdepot.rpc.connection import DepotConnection
from tests.support.raw_registration import FENCE, register
from tests.support.server import small_server

CHUNK = 64
BLOCK = 16
WAIT = 300.0
DRAIN_TIMEOUT = 30
STORES = 6
BLOCKS_PER_STORE = 256  # 64 chunks of 128 KiB: 8 MiB per store


def kv_cache(seed: int) -> torch.Tensor:
    """Blocks for every store, then as many spare ones for the retrieve made during the
    drain: a store submitted before the signal may still be reading its blocks then."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((STORES + 1) * BLOCKS_PER_STORE, 8, BLOCK, 128, generator=generator
                       ).to(torch.bfloat16)


def tokens_of(i: int) -> np.ndarray:
    return np.arange(i * 1_000_000, i * 1_000_000 + BLOCKS_PER_STORE * BLOCK + 1,
                     dtype=np.int32)


def blocks_of(i: int) -> np.ndarray:
    return np.arange(i * BLOCKS_PER_STORE, (i + 1) * BLOCKS_PER_STORE)


def transfer(kind: type, conn: DepotConnection, instance_id: bytes, i: int,
             blocks: np.ndarray | None = None, request_id: str | None = None):
    slot, generation = FENCE.begin()
    future = conn.submit(RequestType.STORE if kind is Store else RequestType.RETRIEVE, kind(
        instance_id=instance_id, request_id=request_id or f"req-{i}",
        token_ids=pack_ints(tokens_of(i)), start=0, end=BLOCKS_PER_STORE * BLOCK,
        block_ids=pack_ints(blocks_of(i) if blocks is None else blocks), fence_slot=slot,
        fence_generation=generation))
    future.add_done_callback(lambda _: FENCE.release(slot))
    return future


def lookup(conn: DepotConnection, i: int, request_id: str) -> int:
    hit = conn.call(RequestType.LOOKUP, Lookup(request_id, KeyScope("m", 1),
                                               pack_ints(tokens_of(i)), 1), timeout=WAIT)
    deadline = time.monotonic() + WAIT
    while hit is None and time.monotonic() < deadline:
        time.sleep(0.01)
        hit = conn.call(RequestType.QUERY_PREFETCH_STATUS, QueryPrefetchStatus(request_id),
                        timeout=WAIT)
    return hit


def draining(url: str) -> bool:
    with AdminClient(url) as admin:
        return admin.stats()["draining"] == 1


def test_sigterm_finishes_transfers_in_flight_and_keeps_every_acknowledged_store(tmp_path):
    disk = ("--disk-path", str(tmp_path / "disk"), "--disk-size", "1GiB")
    server = small_server(chunk_size=CHUNK, l1_size="256MiB",
                          extra=(*disk, "--drain-timeout", str(DRAIN_TIMEOUT))).start()
    kv = kv_cache(seed=1)
    conn = DepotConnection(server.url)
    try:
        instance_id = register(conn, {"l0": kv})
        first = transfer(Store, conn, instance_id, 0).result(WAIT)
        assert first.stored == 64
        # A lookup answered before the drain promises a retrieve made during it.
        assert lookup(conn, 0, "promised") == 64  # chunks
        stores = [transfer(Store, conn, instance_id, i) for i in range(1, STORES)]
        # A ping after them on the same socket: once it is answered, the server has read
        # (and started) every store.
        conn.submit(RequestType.PING).result(WAIT)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + WAIT
        while not draining(server.url) and time.monotonic() < deadline:
            time.sleep(0.01)
        # Nothing new starts: a lookup hits nothing, a store stores nothing, a
        # registration is refused.
        assert lookup(conn, 0, "during") == 0
        late = transfer(Store, conn, instance_id, 0, request_id="late").result(WAIT)
        assert (late.stored, late.present) == (0, 0)
        with pytest.raises(InvalidRequest, match="shutting down"):
            register(conn, {"l0": torch.zeros(8, 2, BLOCK, 16)})
        # The promised retrieve is served, with the right bytes.
        spare = blocks_of(STORES)
        original = kv[blocks_of(0)].clone()
        kv[spare] = 0
        try:
            got = transfer(Retrieve, conn, instance_id, 0, blocks=spare,
                           request_id="promised").result(WAIT)
        except ServerUnavailable:  # what the server said of its drain tells why
            raise AssertionError(f"the drain ended first:\n{server.stop()[-3000:]}") from None
        assert got.retrieved == 64 and torch.equal(kv[spare], original)
        acknowledged = [0] + [i for i, s in enumerate(stores, start=1)
                              if s.result(WAIT).stored == 64]
        assert len(acknowledged) == STORES  # submitted before the signal: all ran
        server.proc.wait(timeout=DRAIN_TIMEOUT + 90)
        out = server.stop()  # exited: what it printed
        exited_after = time.monotonic() - started
    finally:
        conn.close()
        server.stop()
    assert server.proc.returncode == 0, out
    assert exited_after < DRAIN_TIMEOUT + 90
    assert "draining: no new lookups" in out and "kvdepot stopped" in out

    # Every acknowledged store is on disk: a new server serves all of it, byte for byte.
    fresh = kv_cache(seed=1)
    expected = fresh.clone()
    fresh.zero_()
    server.start()
    conn = DepotConnection(server.url)
    try:
        instance_id = register(conn, {"l0": fresh})
        for i in acknowledged:
            assert lookup(conn, i, f"after-{i}") == 64  # chunks
            transfer(Retrieve, conn, instance_id, i, request_id=f"after-{i}").result(WAIT)
            assert torch.equal(fresh[blocks_of(i)], expected[blocks_of(i)]), i
    finally:
        conn.close()
        server.stop()


def test_a_drain_with_nothing_in_flight_ends_at_once_and_a_second_signal_stops():
    server = small_server(chunk_size=CHUNK, extra=("--drain-timeout", "3")).start()
    conn = DepotConnection(server.url)
    try:
        kv = torch.ones(BLOCKS_PER_STORE, 2, BLOCK, 16)
        instance_id = register(conn, {"l0": kv})
        assert transfer(Store, conn, instance_id, 0).result(WAIT).stored == 64
    finally:
        conn.close()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(timeout=120)
    out = server.stop()  # exited: what it printed
    assert server.proc.returncode == 0
    assert "drained: no transfer in flight" in out
    # A second signal does not wait for the drain.
    server.start()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(timeout=120)
    out = server.stop()  # exited: what it printed
    assert server.proc.returncode == 0 and "kvdepot stopped" in out
