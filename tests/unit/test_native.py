"""The C accelerator against its pure-Python fallback: same bytes, same errors.

`make test` builds the extension (pip install -e), so its absence here is a failed build,
not a reason to skip: lookups would silently run at half speed.
"""

import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from kvdepot import native


def test_the_extension_is_built():
    assert native.AVAILABLE, "kvdepot.native._native did not build; see the pip output"


@pytest.fixture(params=[8, 4, 1], ids=["avx2", "sse2", "scalar"])
def simd_width(request):
    width = native._native.set_simd_width(request.param)
    if width != request.param:
        native._native.set_simd_width(8)
        pytest.skip(f"this CPU cannot run batches of {request.param}")
    yield width
    native._native.set_simd_width(8)


@pytest.mark.parametrize("chunk_bytes", [1, 3, 4, 63, 64, 65, 1000, 1023, 1024, 1025, 2048,
                                         3000, 4096, 9000])
@pytest.mark.parametrize("count", [0, 1, 3, 4, 5, 8, 9, 13, 17])
def test_chain_links_match_the_blake3_package(chunk_bytes, count, simd_width):
    """Lengths cover a partial block, whole blocks, one whole BLAKE3 chunk, and trees of
    several chunks; counts cover the eight- and four-at-once paths and their remainders."""
    rng = np.random.default_rng(chunk_bytes * 31 + count)
    data = memoryview(rng.integers(0, 256, chunk_bytes * count + 5, dtype=np.uint8).tobytes())
    previous = rng.integers(0, 256, 32, dtype=np.uint8).tobytes()
    expected = native.reference_chain_links(previous, data, chunk_bytes, count)
    assert native._native.chain_links(previous, data, chunk_bytes, count) == expected


@pytest.mark.parametrize("args", [(b"short", b"x" * 64, 64, 1), (b"k" * 32, b"x" * 64, 0, 1),
                                  (b"k" * 32, b"x" * 64, 64, 2), (b"k" * 32, b"x" * 64, 64, -1)])
def test_chain_links_rejects_what_does_not_fit(args):
    with pytest.raises(ValueError):
        native._native.chain_links(*args)
    with pytest.raises(ValueError):
        native.chain_links(args[0], memoryview(args[1]), args[2], args[3])


@pytest.mark.parametrize("values", [
    [], [0], [1, -1, 2**30 - 1, 2**30, -(2**30), -(2**30) - 1, 2**31 - 1, -(2**31)],
    list(range(100_000, 132_768)), (5, 6, 7),
    np.random.default_rng(0).integers(-(2**31), 2**31, 10_000).tolist(),  # one and two digits
])
def test_pack_int32_matches_struct(values):
    assert native.pack_int32(values) == struct.pack(f"<{len(values)}i", *values)
    assert native._native.pack_int32(values) == struct.pack(f"<{len(values)}i", *values)


@pytest.mark.parametrize("values", [[2**31], [-(2**31) - 1], [1, 2**70]])
def test_pack_int32_out_of_range_is_structs_error(values):
    assert native._native.pack_int32(values) is None  # the C path hands over ...
    with pytest.raises(struct.error):  # ... and the fallback words the error
        native.pack_int32(values)


def test_pack_int32_hands_other_item_types_to_struct():
    assert native._native.pack_int32([1, np.int64(2)]) is None
    assert native.pack_int32([1, np.int64(2)]) == struct.pack("<2i", 1, 2)
    with pytest.raises(struct.error):
        native.pack_int32([1, 2.5])


def test_the_blake3_package_path_can_be_chosen_and_gives_the_same_keys():
    code = ("import numpy as np\n"
            "from kvdepot import native\n"
            "data = memoryview(np.arange(4096, dtype=np.uint8).tobytes())\n"
            "links = native.chain_links(bytes(32), data, 512, 8)\n"
            "print(native.HASHES_IN_C, links == native.reference_chain_links(bytes(32), data, "
            "512, 8), links[-1].hex())")
    outputs = {}
    for value in ("0", "1"):
        env = {**os.environ, native.NATIVE_HASH_VARIABLE: value}
        outputs[value] = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                        capture_output=True, text=True).stdout.split()
    assert outputs["0"][:2] == ["False", "True"]
    assert outputs["1"][:2] == ["True", "True"]
    assert outputs["0"][2] == outputs["1"][2]
