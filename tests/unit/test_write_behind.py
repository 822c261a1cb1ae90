"""Write-behind's backlog (`LowerTier.queued_writes`, the `remote_write_queue_chunks`
gauge): a chunk counts from the moment it is queued until its tier is done with it."""

from __future__ import annotations

import threading

import torch

from kvdepot.keys import ChunkKey
from kvdepot.storage.cpu_tier import CPUTier
from kvdepot.storage.lower_tiers import LowerTiers
from kvdepot.storage.tier import LowerTier
from tests.support.waiting import wait_until

SIZE = 4096


class HeldTier(LowerTier):
    """A lower tier whose writes wait until the test lets them go."""

    def __init__(self) -> None:
        self.writing = threading.Event()
        self.go = threading.Event()
        self.chunks: dict[ChunkKey, bytes] = {}

    def stored_size(self, key):
        data = self.chunks.get(key)
        return None if data is None else len(data)

    def read_into(self, key, fingerprint_out, buffer):
        return False

    def write(self, key, fingerprint, data):
        self.writing.set()
        assert self.go.wait(30)
        self.chunks[key] = bytes(data)


def test_the_batch_being_written_still_counts_as_waiting():
    memory = CPUTier(torch.zeros(8 * SIZE, dtype=torch.uint8))
    keys = [bytes([i]) * 34 for i in range(3)]
    for key in keys:
        _, chunk = memory.reserve(key, SIZE, b"fp")
        memory.commit(chunk)
    tier = HeldTier()
    lower = LowerTiers(memory, [tier])
    try:
        lower.write_behind(keys)
        assert tier.writing.wait(30)
        # The writer is stuck in its first write: none of the three is written yet,
        # whether still queued or taken into its batch.
        assert tier.queued_writes() == 3
        tier.go.set()
        wait_until(lambda: tier.queued_writes() == 0, "the backlog emptying")
        assert sorted(tier.chunks) == keys
    finally:
        tier.go.set()
        lower.close()
