"""The server maps the memory engines hand over; nothing a client does to those files may
crash it. Before sealing, a worker that shrank its own KV memory file after registering
made the server's next copy fault (SIGBUS) and the whole server died with it."""

from __future__ import annotations

import os

import pytest
import torch

from kvdepot.client.memory_handover import hand_over
from kvdepot.errors import InvalidRequest
from kvdepot.protocol import RequestType
from kvdepot.rpc.connection import DepotConnection
from tests.support.raw_registration import FENCE, hand_over_memory

CHUNK = 64  # the server fixture's chunk size
PROMPT = list(range(2000, 2000 + 2 * CHUNK + 1))
OTHER_PROMPT = list(range(7000, 7000 + 2 * CHUNK + 1))
BLOCKS = list(range(8))
WAIT = 300.0


def test_a_worker_truncating_its_memory_cannot_crash_the_server(server, engines):
    victim, hostile = engines(), engines()
    victim.fill(seed=3)
    hostile.fill(seed=4)
    victim.store("before", PROMPT, BLOCKS, 0, 2 * CHUNK)

    # Every file the hostile worker handed over (its KV memory and its fence) is sealed
    # against shrinking: the kernel refuses, and the worker sees the error.
    assert set(hostile.truncate_handed_over_files()) == {"PermissionError"}
    # Its copies go on (the memory is intact), stores and loads alike.
    hostile.store("h", OTHER_PROMPT, BLOCKS, 0, 2 * CHUNK)
    assert hostile.retrieve("h", OTHER_PROMPT, list(range(8, 16)), 0, 2 * CHUNK) == set()

    assert server.proc.poll() is None, "the server died"
    assert victim.lookup("after", PROMPT) == 2 * CHUNK
    assert victim.retrieve("after", PROMPT, list(range(16, 24)), 0, 2 * CHUNK) == set()
    assert victim.healthy() == (True, True)


@pytest.mark.parametrize("what", ["memory", "fence"])
def test_the_server_refuses_memory_that_could_shrink_under_it(server, what):
    """A client that bypasses the worker and hands over an unsealed file (which it could
    shrink at any time) is refused before anything is mapped."""
    conn = DepotConnection(server.url)
    try:
        request, fds = hand_over_memory(conn, {"l0": torch.zeros(8, 2, 16, 64,
                                                                 dtype=torch.bfloat16)})
        unsealed = os.memfd_create("unsealed")
        size = request.fence.nbytes if what == "fence" else request.allocations[0].nbytes
        os.ftruncate(unsealed, size)
        handed = [unsealed, FENCE.fd] if what == "memory" else [fds[0], unsealed]
        pong = conn.call(RequestType.PING, timeout=WAIT)
        request.handover_ticket = hand_over(pong, conn.credential, handed, WAIT)
        os.close(unsealed)
        with pytest.raises(InvalidRequest, match="sealed"):
            conn.submit(RequestType.REGISTER_KV_CACHE, request).result(WAIT)
        assert server.proc.poll() is None
    finally:
        conn.close()


def test_registering_the_same_tensors_again_moves_them_again(server, engines):
    """A retried registration finds its tensors already in a sealed memfd of its own;
    they move into a new one, keeping their bytes, and the old one is let go."""
    engine = engines()
    engine.fill(seed=8)
    engine.register_again()
    engine.store("again", PROMPT, BLOCKS, 0, 2 * CHUNK)
    assert engine.retrieve("again", PROMPT, list(range(8, 16)), 0, 2 * CHUNK) == set()
    assert all(bool(torch.equal(a, b)) for a, b in zip(
        engine.read_blocks(BLOCKS), engine.read_blocks(list(range(8, 16))), strict=True))
    assert set(engine.truncate_handed_over_files()) == {"PermissionError"}
