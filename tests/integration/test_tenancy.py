"""Issue 12, item 2, and issue 9's per-tenant caps: tenants competing for one server's
CPU memory through real server processes and real clients.

Every engine here stores one-chunk prompts (32 KiB per chunk: 2 layers, 4 blocks of 16
tokens), so each prompt is one chunk that lives or goes on its own, and a lookup of it
tells whether that chunk is held.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvdepot.errors import InvalidRequest
from kvdepot.protocol import KeyScope, Lookup, RequestType, pack_ints
from kvdepot.rpc.connection import DepotConnection
from tests.support.credentials import credential_file
from tests.support.engine import EngineProcess
from tests.support.server import small_server, stats

CHUNK = 64
CHUNK_KIB = 32
BLOCKS = [0, 1, 2, 3]
WAIT = 300.0


def prompt(tenant_seed: int, i: int, chunks: int = 1) -> list[int]:
    start = 100_000 * tenant_seed + 1_000 * i
    return list(range(start, start + chunks * CHUNK + 1))


@pytest.fixture
def credentials(state_dir: Path) -> Callable[[str], str]:
    """A credential file of an engine of `tenant` (named after it), added once: a test asks
    again for the same tenant's."""
    def make(tenant: str) -> str:
        path = state_dir / f"{tenant}.cred"
        return str(path) if path.exists() else credential_file(state_dir, tenant, "engine",
                                                                tenant)

    return make


_probes = itertools.count()


def held(engine: EngineProcess, seed: int, count: int) -> list[int]:
    """Which of the engine's one-chunk prompts 0..count-1 the server holds."""
    found = []
    for i in range(count):
        request_id = f"probe-{next(_probes)}"  # fresh: the client keeps answers per id
        if engine.lookup(request_id, prompt(seed, i)) == CHUNK:
            found.append(i)
        engine.call("scheduler", "end_session", request_id)
    return found


def test_quota_and_reserve_hold_while_two_tenants_burst(state_dir, credentials, engines_at):
    # 1 MiB holds 32 chunks. alpha is guaranteed 8 of them, beta may hold at most 16.
    server = small_server(chunk_size=CHUNK, l1_size="1MiB", extra=(
        "--tenant-reserve", f"alpha={8 * CHUNK_KIB}KiB",
        "--tenant-quota", f"beta={16 * CHUNK_KIB}KiB")).start()
    try:
        alpha = engines_at(server.url, credentials=credentials("alpha"), num_blocks=8)
        beta = engines_at(server.url, credentials=credentials("beta"), num_blocks=8)
        gamma = engines_at(server.url, credentials=credentials("gamma"), num_blocks=8)
        for seed, engine in ((1, alpha), (2, beta), (3, gamma)):
            engine.fill(seed=seed)
        for i in range(10):
            alpha.store(f"a{i}", prompt(1, i), BLOCKS, 0, CHUNK)
        # beta's burst of 30 chunks evicts only its own: memory has room for the rest.
        for i in range(30):
            beta.store(f"b{i}", prompt(2, i), BLOCKS, 0, CHUNK)
        after = stats(server.url)
        assert after["chunks"] == 10 + 16 and after["evictions"] == 30 - 16
        assert held(beta, 2, 30) == list(range(14, 30))  # its newest 16
        assert held(alpha, 1, 10) == list(range(10))

        # gamma (no quota, no reserve) fills memory: beta has no guaranteed share and
        # goes; alpha keeps its reserve, its 8 most recently used chunks.
        for i in range(40):
            gamma.store(f"g{i}", prompt(3, i), BLOCKS, 0, CHUNK)
        assert held(alpha, 1, 10) == list(range(2, 10))
        assert held(beta, 2, 30) == []
        assert held(gamma, 3, 40) == list(range(16, 40))
        assert stats(server.url)["store_skipped_full_chunks"] == 0
        # What alpha kept are its own bytes.
        for i in range(2, 10):
            alpha.store(f"again{i}", prompt(1, i), BLOCKS, 0, CHUNK)  # refreshes nothing
            assert alpha.retrieve(f"r{i}", prompt(1, i), [4, 5, 6, 7], 0, CHUNK) == set()
            for mine, loaded in zip(alpha.read_blocks(BLOCKS), alpha.read_blocks([4, 5, 6, 7]),
                                    strict=True):
                assert torch.equal(mine, loaded)
    finally:
        log = server.stop()
    assert "Traceback" not in log


def test_a_tenant_s_connections_share_one_bound_on_locked_memory(state_dir, credentials,
                                                                 engines_at):
    server = small_server(chunk_size=CHUNK, l1_size="1MiB",
                          extra=("--max-locked-share", "0.5")).start()
    try:
        alpha = engines_at(server.url, credentials=credentials("alpha"), num_blocks=128)
        alpha.fill(seed=5)
        tokens = prompt(1, 0, chunks=32)
        alpha.store("fill", tokens, list(range(128)), 0, 32 * CHUNK)
        greedy = [DepotConnection(server.url, credentials=credentials("alpha"))
                  for _ in range(4)]
        scope = KeyScope("test-model", 1)
        for n, conn in enumerate(greedy):
            # The first connection locks half of memory, the most alpha may; the others
            # get the same half again (counted once), never more.
            hit = conn.call(RequestType.LOOKUP, Lookup(f"greedy-{n}", scope, pack_ints(tokens),
                                                       1024), timeout=WAIT)
            assert hit == 16
        after = stats(server.url)
        assert after["locked_chunks"] == 16 and after["lookups_lock_capped"] == 4
        # Another tenant's stores still find room among the unlocked half.
        beta = engines_at(server.url, credentials=credentials("beta"), num_blocks=128)
        beta.fill(seed=6)
        beta.store("beta", prompt(2, 0, chunks=16), list(range(64)), 0, 16 * CHUNK)
        after = stats(server.url)
        assert after["store_skipped_full_chunks"] == 0 and after["stored_chunks"] == 48
        for conn in greedy:
            conn.close()
    finally:
        server.stop()


def test_one_tenant_cannot_take_every_registration(state_dir, credentials):
    from kvdepot.server.depot import (
        MAX_REGISTRATIONS_PER_CONNECTION,
        MAX_REGISTRATIONS_PER_TENANT,
    )
    from tests.support.raw_registration import register

    server = small_server(chunk_size=CHUNK).start()
    caches = {"layer": torch.zeros(4, 2, 16, 16)}
    conns = []
    try:
        needed = MAX_REGISTRATIONS_PER_TENANT // MAX_REGISTRATIONS_PER_CONNECTION
        for _ in range(needed):
            conn = DepotConnection(server.url, credentials=credentials("mallory"))
            conns.append(conn)
            for _ in range(MAX_REGISTRATIONS_PER_CONNECTION):
                register(conn, caches)
        fresh = DepotConnection(server.url, credentials=credentials("mallory"))
        conns.append(fresh)
        with pytest.raises(InvalidRequest, match="most one tenant may"):
            register(fresh, caches)
        # Another tenant, and the owner, still register.
        for who in (credentials("alice"), None):
            conn = DepotConnection(server.url, credentials=who)
            conns.append(conn)
            assert len(register(conn, caches)) == 16
        assert stats(server.url)["registered_engines"] == MAX_REGISTRATIONS_PER_TENANT + 2
    finally:
        for conn in conns:
            conn.close()
        server.stop()
