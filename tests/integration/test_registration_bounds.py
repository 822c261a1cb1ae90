"""Registration bounds are checked with the registration applied, under one lock, and
before a registration it replaces is dropped: a refused re-registration leaves the
worker's registration working."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from typing import Any

import msgspec
import pytest
import torch

from kvdepot.errors import InvalidRequest
from kvdepot.protocol import ENCODER, RegisterKVCache, RequestType, Store, pack_ints
from kvdepot.rpc.connection import DepotConnection
from tests.support.raw_registration import FENCE, hand_over_memory, register
from tests.support.server import running_server

CHUNK = 64
WAIT = 300.0


def test_a_refused_re_registration_keeps_the_one_it_would_replace():
    with running_server(chunk_size=CHUNK, l1_size="1MiB") as server:
        conn = DepotConnection(server.url)
        try:
            first = register(conn, {"l0": torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)})
            # 16-token blocks of 512 KiB: a 64-token chunk takes 2 MiB, more than the cache.
            too_big = {"l0": torch.zeros(4, 64, 16, 128, dtype=torch.float32)}
            with pytest.raises(InvalidRequest, match="more than the server's whole CPU memory"):
                register(conn, too_big, replaces=first)
            slot, generation = FENCE.begin()
            store = Store(instance_id=first, request_id="r",
                          token_ids=pack_ints(range(CHUNK + 1)), start=0, end=CHUNK,
                          block_ids=pack_ints([0, 1, 2, 3]), fence_slot=slot,
                          fence_generation=generation)
            assert conn.submit(RequestType.STORE, store).result(WAIT).stored == 1
            FENCE.release(slot)
        finally:
            conn.close()


def test_a_killed_engines_registration_is_reaped(server, engines):
    """Killed workers never unregister: the server notices their process is gone (off
    its control thread) and releases their registration."""
    import time

    from kvdepot.client.admin import AdminClient

    survivor, killed = engines(), engines()
    with AdminClient(server.url) as admin:
        assert admin.stats()["registered_engines"] == 2
        killed.kill()
        deadline = time.monotonic() + 60
        while admin.stats()["registered_engines"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = admin.stats()
    assert stats["registered_engines"] == 1 and stats["reaped_engines"] == 1
    assert survivor.healthy() == (True, True)


def _hand_over_and_exit(url: str, out: Any) -> None:
    """A worker that hands its memory over and dies before its registration is served."""
    conn = DepotConnection(url)
    request, _ = hand_over_memory(conn, {"l0": torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)})
    out.send_bytes(ENCODER.encode(request))
    conn.close()


def _server_memfds(pid: int) -> list[str]:
    names = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            names.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return [name for name in names if name.startswith("/memfd:")]


def test_a_registration_served_after_its_worker_died_is_refused_and_keeps_nothing(server):
    """A worker's REGISTER_KV_CACHE can wait in the server's queue (a stalled server) while
    the worker dies. The server must not register it: no one would ever unregister it,
    and a registration it cannot watch would hold the memory and the fence forever."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    worker = ctx.Process(target=_hand_over_and_exit, args=(server.url, theirs))
    worker.start()
    assert ours.poll(WAIT), "the worker never handed its memory over"
    request = msgspec.msgpack.decode(ours.recv_bytes(), type=RegisterKVCache)
    worker.join(WAIT)
    assert worker.exitcode == 0 and request.engine_pid == worker.pid
    conn = DepotConnection(server.url)
    try:
        with pytest.raises(InvalidRequest, match="has exited"):
            conn.submit(RequestType.REGISTER_KV_CACHE, request).result(WAIT)
        stats = conn.call(RequestType.STATS, timeout=WAIT).values
    finally:
        conn.close()
    assert stats["registered_engines"] == 0
    assert _server_memfds(server.proc.pid) == []
