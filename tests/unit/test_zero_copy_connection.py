"""ZeroCopyConnection packs what redis-py packs, byte for byte, and sends big arguments
from the caller's own memory."""

from __future__ import annotations

import numpy as np
import pytest
from redis.connection import Connection

from kvdepot.storage.zero_copy_connection import ZERO_COPY_BYTES, ZeroCopyConnection


def joined(parts: list) -> bytes:
    return b"".join(bytes(part) for part in parts)


@pytest.mark.parametrize("size", [0, 5, ZERO_COPY_BYTES - 1, ZERO_COPY_BYTES, 3 << 20])
def test_commands_pack_as_redis_py_packs_them(size):
    ours, theirs = ZeroCopyConnection(), Connection()
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    for command in [("SET", "kvdepot:1:ab:0", memoryview(payload), "EX", 3600),
                    ("SET", b"k", payload.tobytes()),
                    ("GETEX", "kvdepot:1:ab:0", "EX", 60),
                    ("CONFIG SET", "maxmemory", memoryview(payload))]:
        assert joined(ours.pack_commands([command, ("PING",)])) == \
            joined(theirs.pack_commands([command, ("PING",)]))


def test_big_arguments_are_sent_from_the_callers_memory():
    payload = np.zeros(ZERO_COPY_BYTES, dtype=np.uint8)
    parts = ZeroCopyConnection().pack_commands([("SET", "k", memoryview(payload))])
    views = [part for part in parts if isinstance(part, memoryview)]
    assert len(views) == 1 and views[0].nbytes == ZERO_COPY_BYTES
    payload[:] = 7  # the packed command sees the change: it holds no copy
    assert bytes(views[0][:1]) == b"\x07"
    small = ZeroCopyConnection().pack_commands([("SET", "k", memoryview(payload[:100]))])
    assert not any(isinstance(part, memoryview) for part in small)
