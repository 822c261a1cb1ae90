"""Server counters, readable through STATS and (optionally) Prometheus."""

from __future__ import annotations

import threading
from collections import Counter


class Counters:
    NAMES = (
        "lookups", "lookup_requested_tokens", "hit_tokens", "hit_chunks",
        "stores", "stored_chunks", "store_present_chunks", "store_skipped_full_chunks",
        "store_errors", "retrieves", "retrieved_chunks", "retrieve_errors",
        "stored_bytes", "retrieved_bytes", "block_allocation_reports", "expired_lookups",
    )

    def __init__(self) -> None:
        self._values: Counter[str] = Counter({name: 0 for name in self.NAMES})
        self._mutex = threading.Lock()

    def add(self, **increments: int) -> None:
        with self._mutex:
            self._values.update(increments)

    def snapshot(self) -> dict[str, float]:
        with self._mutex:
            return {k: float(v) for k, v in self._values.items()}
