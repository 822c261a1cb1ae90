"""The lookup path's two hot loops, in C where the extension was built.

`pack_int32` turns a list of token ids into bytes (client side), `chain_links` hashes
a prompt's chunks into chain links (server side). `_native.c` implements both; this
module falls back to `struct` and the blake3 package, with identical results, where the
extension is missing (a machine without a C compiler, or a source tree run straight
from PYTHONPATH). `AVAILABLE` says whether the extension is there, `HASHES_IN_C` whether
key chains are hashed by it (`KVDEPOT_NATIVE_HASH=0` turns that off).
"""

from __future__ import annotations

import functools
import os
import struct

from blake3 import blake3

try:
    from kvdepot.native import _native
except ImportError:  # not built: same results, slower
    _native = None

AVAILABLE = _native is not None
NATIVE_HASH_VARIABLE = "KVDEPOT_NATIVE_HASH"
"""Set to 0 to hash key chains with the blake3 package even where the extension is
built: a diagnostic, to compare the two at the product level (`kvdepot bench control`).
The keys are the same bytes either way."""
HASHES_IN_C = AVAILABLE and os.environ.get(NATIVE_HASH_VARIABLE, "1") != "0"


@functools.lru_cache(maxsize=64)
def _int32_struct(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}i")


def pack_int32(values: list[int] | tuple[int, ...]) -> bytes:
    """Little-endian int32 bytes; struct.error for a value that does not fit."""
    if _native is not None:
        packed = _native.pack_int32(values)
        if packed is not None:
            return packed
    # Also the path that words the error for a value that is not an int32. A compiled
    # Struct converts a list twice as fast as struct.pack with a format string.
    return _int32_struct(len(values)).pack(*values)


def reference_chain_links(previous: bytes, data: memoryview, chunk_bytes: int,
                          count: int) -> list[bytes]:
    """The definition of the key chain, in plain Python: link = BLAKE3 keyed with the
    previous link, of BLAKE3(chunk). The C code must give the same bytes (test_native)."""
    links = []
    for offset in range(0, count * chunk_bytes, chunk_bytes):
        previous = blake3(blake3(data[offset:offset + chunk_bytes]).digest(),
                          key=previous).digest()
        links.append(previous)
    return links


def chain_links(previous: bytes, data: memoryview, chunk_bytes: int, count: int
                ) -> list[bytes]:
    """The `count` links after `previous` over the first chunks of `data`:
    link = BLAKE3 keyed with the previous link, of BLAKE3(chunk).

    Hashing each chunk on its own lets the C code hash eight chunks at once (AVX2; four
    with SSE2); only the 32-byte outer step is sequential."""
    if count * chunk_bytes > len(data) or chunk_bytes < 1 or count < 0:
        raise ValueError(f"{count} chunks of {chunk_bytes} bytes do not fit in "
                         f"{len(data)} bytes")
    if HASHES_IN_C:
        return _native.chain_links(previous, data, chunk_bytes, count)
    return reference_chain_links(previous, data, chunk_bytes, count)
