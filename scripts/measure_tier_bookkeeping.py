"""What the CPU tier's bookkeeping costs per chunk: locking a 128-chunk prefix (a
lookup's hot loop) and unlocking it, and storing a chunk into a full tier (one
eviction). Compare two trees by running it under each one's PYTHONPATH:

    PYTHONPATH=/path/to/tree/src python scripts/measure_tier_bookkeeping.py

Prints the best of several rounds (the machine's noise only ever adds time)."""

from __future__ import annotations

import time
import timeit

import torch

from kvdepot.storage.cpu_tier import CPUTier

CHUNKS = 4096
PREFIX = 128


def main() -> None:
    tier = CPUTier(torch.zeros(CHUNKS * 4096, dtype=torch.uint8))
    keys = [i.to_bytes(34, "big") for i in range(6 * CHUNKS)]
    for key in keys[:CHUNKS]:
        _, chunk = tier.reserve(key, 4096, b"fp")
        tier.commit(chunk)
    prefix = [[key] for key in keys[CHUNKS - PREFIX:CHUNKS]]
    counts = dict.fromkeys(keys[CHUNKS - PREFIX:CHUNKS], 1)

    def lock_and_unlock() -> None:
        tier.lock_prefix(iter(prefix), 1)
        tier.unlock(counts)

    rounds = 2000
    best = min(timeit.repeat(lock_and_unlock, number=rounds, repeat=9)) / rounds
    print(f"lock_prefix + unlock of {PREFIX} chunks: {best * 1e6:.1f} us")
    best = float("inf")
    for r in range(1, 5):
        start = time.perf_counter()
        for key in keys[r * CHUNKS:(r + 1) * CHUNKS]:
            _, chunk = tier.reserve(key, 4096, b"fp")
            tier.commit(chunk)
        best = min(best, (time.perf_counter() - start) / CHUNKS)
    print(f"reserve + commit into a full tier (one eviction each): {best * 1e6:.2f} us")


if __name__ == "__main__":
    main()
