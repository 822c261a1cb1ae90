"""Issue 27, part 4: a registration costs the server no memory the engine did not write.

A tenant credential holder hands the server 2 GiB memfds it never wrote (sparse: no page
allocated). The server used to map them with MAP_POPULATE, which allocated every page of
the file (tmpfs allocates on a read fault too): host Shmem and the server's RSS grew by
2 GiB per registration (the memfds' own blocks show it, whatever else the host does).
Now the server maps only what the engine wrote, and bounds the
bytes one tenant (and all together) may register; a normal registration still stores and
retrieves byte-exact.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvdepot.client.memory_handover import HandoverFiles, hand_over
from kvdepot.errors import InvalidRequest
from kvdepot.protocol import (
    LayerSpec,
    RegisterKVCache,
    RequestType,
    Retrieve,
    Store,
    pack_ints,
)
from kvdepot.rpc.connection import DepotConnection
from kvdepot.transfer.sealed_memory import create_sealable, seal_size
from tests.support.credentials import credential_file
from tests.support.raw_registration import FENCE, register
from tests.support.server import small_server

CHUNK = 64
BLOCK_TOKENS = 16
ROW = 256
BLOCK_BYTES = BLOCK_TOKENS * ROW
SPARSE = 2 << 30
WAIT = 300.0
MIB = 1 << 20


def register_sparse(conn: DepotConnection, nbytes: int) -> int:
    """Hand over a sealed memfd of `nbytes` that nobody ever wrote, described as one uint8
    layer of 4 KiB blocks, and register it; returns the memfd (the caller closes it)."""
    fd = create_sealable("sparse-kv", nbytes)
    try:
        seal_size(fd)
        files = HandoverFiles()
        memory = files.add(fd, nbytes)
        fence = files.add(FENCE.fd, FENCE.nbytes)
        blocks = nbytes // BLOCK_BYTES
        layer = LayerSpec(name="l0", allocation=0, dtype="uint8",
                          shape=[blocks, BLOCK_TOKENS, ROW], strides=[BLOCK_BYTES, ROW, 1],
                          storage_offset=0, block_axis=0)
        server = conn.call(RequestType.PING, timeout=WAIT)
        ticket = hand_over(server, conn.credential, files.fds, WAIT)
        request = RegisterKVCache(model="m", world_size=1, rank=0, block_size=BLOCK_TOKENS,
                                  allocations=[memory], layers=[layer], engine_pid=os.getpid(),
                                  handover_ticket=ticket, fence=fence)
        conn.submit(RequestType.REGISTER_KV_CACHE, request).result(WAIT)
        return fd
    except BaseException:
        os.close(fd)
        raise


def server_memory(pid: int) -> int:
    """The server's resident memory, shared pages included: VmRSS (RssAnon + RssFile +
    RssShmem) as /proc reports it."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) * 1024


def allocated(fd: int) -> int:
    """Bytes of the memfd that hold pages, whoever touched them (the server's mapping
    included): tmpfs counts them in the file's blocks."""
    return os.fstat(fd).st_blocks * 512


def test_sparse_registrations_cost_nothing_and_are_bounded(state_dir):
    server = small_server(chunk_size=CHUNK, extra=(
        "--tenant-max-registered-memory", "5GiB")).start()
    conns: list[DepotConnection] = []
    fds: list[int] = []
    try:
        mallory = credential_file(state_dir, "mallory", "engine", "mallory")
        rss_before = server_memory(server.proc.pid)
        for _ in range(2):
            conn = DepotConnection(server.url, credentials=mallory)
            conns.append(conn)
            fds.append(register_sparse(conn, SPARSE))
        rss_after = server_memory(server.proc.pid)
        pages = [allocated(fd) for fd in fds]
        print(f"server VmRSS {rss_before / MIB:.0f} -> {rss_after / MIB:.0f} MiB, memfds' "
              f"pages {pages} bytes after 2 x 2 GiB registered")
        assert rss_after - rss_before < 16 * MIB
        assert pages == [0, 0]  # MAP_POPULATE allocated all 2 GiB of each
        # A third would pass the tenant's 5 GiB.
        conn = DepotConnection(server.url, credentials=mallory)
        conns.append(conn)
        with pytest.raises(InvalidRequest, match="--tenant-max-registered-memory"):
            fds.append(register_sparse(conn, SPARSE))
        # A normal registration of the same tenant, within the bound, works byte-exact.
        caches = {"l0": torch.randint(0, 255, (8, 2, BLOCK_TOKENS, 64), dtype=torch.uint8)}
        original = caches["l0"].clone()
        conn = DepotConnection(server.url, credentials=mallory)
        conns.append(conn)
        instance = register(conn, caches)
        tokens = pack_ints(range(1, CHUNK + 2))
        transfer = dict(instance_id=instance, request_id="r", token_ids=tokens, start=0,
                        end=CHUNK)
        slot, generation = FENCE.begin()
        stored = conn.submit(RequestType.STORE, Store(
            **transfer, block_ids=pack_ints([0, 1, 2, 3]), fence_slot=slot,
            fence_generation=generation)).result(WAIT)
        FENCE.release(slot)
        assert stored.stored == 1
        slot, generation = FENCE.begin()
        conn.submit(RequestType.RETRIEVE, Retrieve(
            **transfer, block_ids=pack_ints([4, 5, 6, 7]), fence_slot=slot,
            fence_generation=generation)).result(WAIT)
        FENCE.release(slot)
        assert torch.equal(caches["l0"][4:8], original[0:4])
        assert torch.equal(caches["l0"][0:4], original[0:4])
    finally:
        for conn in conns:
            conn.close()
        server.stop()
        for fd in fds:
            os.close(fd)
