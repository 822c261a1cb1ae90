"""ZeroCopyConnection packs what redis-py's default (hiredis) packer packs, byte for byte,
and sends values from the caller's own memory."""

from __future__ import annotations

import numpy as np
import pytest
from redis.connection import Connection

from kvdepot.storage.shared.zero_copy_connection import ZeroCopyConnection


def joined(parts: list) -> bytes:
    return b"".join(bytes(part) for part in parts)


@pytest.mark.parametrize("size", [0, 5, 6000, 6001, 64 << 10, 3 << 20])
def test_commands_pack_as_redis_py_packs_them(size):
    ours, theirs = ZeroCopyConnection(), Connection()
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    for command in [("SET", "kvdepot:1:ab:0", memoryview(payload), "EX", 3600),
                    ("SET", b"k", payload.tobytes()),
                    ("GETEX", "kvdepot:1:ab:0", "EX", 60),
                    ("CONFIG SET", "maxmemory", memoryview(payload))]:
        assert joined(ours.pack_commands([command, ("PING",)])) == \
            joined(theirs.pack_commands([command, ("PING",)]))


def test_values_are_sent_from_the_callers_memory():
    payload = np.zeros(4 << 20, dtype=np.uint8)
    parts = ZeroCopyConnection().pack_commands([("SET", "k", memoryview(payload)),
                                                ("SET", "k2", memoryview(payload[:1 << 20]))])
    views = [part for part in parts if isinstance(part, memoryview)]
    assert [view.nbytes for view in views] == [4 << 20, 1 << 20]
    payload[:] = 7  # the packed commands see the change: they hold no copy
    assert bytes(views[0][:1]) == b"\x07" and bytes(views[1][-1:]) == b"\x07"
    assert sum(len(part) for part in parts if not isinstance(part, memoryview)) < 200
