import numpy as np

from kvdepot.storage.disk_tier import DiskTier


def payload(n: int, seed: int) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8).tobytes())


def test_write_read_and_survive_a_restart(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    tier.write(b"k1", b"fp-1", payload(5000, 1))
    assert tier.stored_size(b"k1") == 5000
    buf, fp = bytearray(5000), bytearray()
    assert tier.read_into(b"k1", fp, memoryview(buf))
    assert bytes(buf) == bytes(payload(5000, 1)) and fp == b"fp-1"
    again = DiskTier(tmp_path, 1 << 20)
    assert again.stored_size(b"k1") == 5000
    buf2 = bytearray(5000)
    assert again.read_into(b"k1", bytearray(), memoryview(buf2)) and buf2 == buf


def test_wrong_size_or_damaged_files_do_not_read(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    tier.write(b"k", b"fp", payload(1000, 2))
    assert not tier.read_into(b"k", bytearray(), memoryview(bytearray(999)))
    (tmp_path / f"{b'k'.hex()}.chunk").write_bytes(b"garbage")
    assert not tier.read_into(b"k", bytearray(), memoryview(bytearray(1000)))
    assert tier.stored_size(b"k") is None


def test_capacity_drops_least_recently_used(tmp_path):
    tier = DiskTier(tmp_path, 3 * 1100)
    for i in range(3):
        tier.write(bytes([i]), b"fp", payload(1000, i))
    tier.read_into(bytes([0]), bytearray(), memoryview(bytearray(1000)))  # 0 is now recent
    tier.write(b"\x09", b"fp", payload(1000, 9))
    assert tier.stored_size(bytes([1])) is None
    assert tier.stored_size(bytes([0])) == 1000 and tier.stored_size(b"\x09") == 1000
    assert len(list(tmp_path.glob("*.chunk"))) == 3
