"""Disk tier integrity (issue 9, finding 6): a damaged chunk file is never served or
promised; it is deleted and counted."""

from pathlib import Path

import pytest
import torch

from kvdepot.client.admin import AdminClient
from kvdepot.keys import chain_hashes, rank_key, scope_root
from kvdepot.protocol import TOKEN_DTYPE, KeyScope
from tests.support.server import small_server, stats
from tests.support.waiting import wait_for_writes

CHUNK = 64
TOKENS = list(range(4000, 4000 + 3 * CHUNK + 1))


def chunk_file(directory: Path, index: int) -> Path:
    import numpy as np

    root = scope_root(KeyScope("test-model", 1))
    hashes = chain_hashes(root, np.asarray(TOKENS, dtype=TOKEN_DTYPE), CHUNK, 3)
    return directory / f"{rank_key(hashes[index], 0).hex()}.chunk"


def fingerprint_offset(data: bytes) -> int:
    """Where the layout fingerprint starts: after the header of the file's format."""
    return {b"KVDC1": 14, b"KVDC2": 46, b"KVDC3": 47}[data[:5]]


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flipped_payload_byte":
        data[-100] ^= 0x01
    elif how == "truncated":
        del data[-100:]
    elif how == "damaged_fingerprint":
        data[fingerprint_offset(bytes(data)) + 3] ^= 0x80
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flipped_payload_byte", "truncated", "damaged_fingerprint"])
def test_a_damaged_chunk_file_is_deleted_counted_and_never_promised(engines_at, tmp_path,
                                                                    how):
    directory = tmp_path / "disk"
    server = small_server(chunk_size=CHUNK, extra=("--disk-path", str(directory),
                                                    "--disk-size", "64MiB")).start()
    try:
        engine = engines_at(server.url)
        engine.fill(seed=31)
        engine.store("w", TOKENS, list(range(12)), 0, 3 * CHUNK)
        expected = engine.read_blocks(list(range(4)))
        wait_for_writes(server.url, 3)
        with AdminClient(server.url) as admin:
            assert admin.clear() == 3
        damaged = chunk_file(directory, 1)
        damage(damaged, how)

        # Only the chunk before the damaged one is promised, and it loads byte-exact.
        assert engine.lookup("r", TOKENS) == CHUNK
        engine.write_through_old_view(0.0)
        assert engine.retrieve("r", TOKENS, list(range(20, 24)), 0, CHUNK) == set()
        for a, b in zip(expected, engine.read_blocks(list(range(20, 24))), strict=True):
            assert torch.equal(a, b)
        assert not damaged.exists()
        assert stats(server.url)["lower_tier_discarded_chunks"] == 1
        # The file is gone: the next lookup does not read it again, and nothing more is
        # discarded.
        assert engine.lookup("again", TOKENS) == CHUNK
        assert stats(server.url)["lower_tier_discarded_chunks"] == 1
    finally:
        server.stop()


def test_a_truncated_file_found_at_start_is_deleted(engines_at, tmp_path):
    directory = tmp_path / "disk"
    disk = ("--disk-path", str(directory), "--disk-size", "64MiB")
    server = small_server(chunk_size=CHUNK, extra=disk).start()
    try:
        engine = engines_at(server.url)
        engine.store("w", TOKENS, list(range(12)), 0, 3 * CHUNK)
        wait_for_writes(server.url, 3)
    finally:
        server.stop()
    damage(chunk_file(directory, 2), "truncated")
    server = small_server(chunk_size=CHUNK, extra=disk).start()
    try:
        assert not chunk_file(directory, 2).exists()
        assert stats(server.url)["lower_tier_discarded_chunks"] == 1
        fresh = engines_at(server.url)
        assert fresh.lookup("r", TOKENS) == 2 * CHUNK
    finally:
        server.stop()
