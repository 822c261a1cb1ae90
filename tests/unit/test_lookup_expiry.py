"""Lock expiry runs on the control loop: each pass looks only at the jobs it expires,
oldest first, and drops a bounded number of them."""

from __future__ import annotations

import time

from kvdepot.server.lookups import LookupTable
from tests.unit.test_lookup_caps import CHUNKS, KEYS, filled_tier, locked


def test_expiry_drops_the_oldest_jobs_first_and_at_most_its_limit():
    tier = filled_tier(KEYS)
    table = LookupTable(tier, 0.0)
    for i in range(3):
        table.start(f"old-{i}", locked(tier, CHUNKS[i:i + 1]), 1, peer=b"p")
    table.lock_ttl = 3600.0
    table.start("young", locked(tier, CHUNKS[3:4]), 1, peer=b"p")
    later = time.monotonic() + 1
    assert table.expire(later, limit=2) == 2
    assert [tier.lock_count(k) for k in KEYS[:4]] == [0, 0, 1, 1]  # the two oldest
    assert table.expire(later, limit=2) == 1  # the third, then the young one stops it
    assert table.expire(later, limit=2) == 0
    assert len(table) == 1 and table.query("young") == 1
    assert [tier.lock_count(k) for k in KEYS[:4]] == [0, 0, 0, 1]
