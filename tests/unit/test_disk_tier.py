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


def test_a_tenant_past_its_disk_quota_loses_its_own_oldest_files(tmp_path):
    from kvdepot.storage.chunk import ChunkScope
    from kvdepot.storage.tenant_limits import TenantLimits

    size = 1000 + 100  # payload and header, roughly: the quota is counted in file bytes
    tier = DiskTier(tmp_path, 1 << 20, limits=TenantLimits({"a": 3 * size}))
    tier.write_chunk(b"b0", b"fp", payload(1000, 0), ChunkScope("b"))
    for i in range(5):
        tier.write_chunk(bytes([i]), b"fp", payload(1000, i), ChunkScope("a"))
    assert [tier.stored_size(bytes([i])) for i in range(5)] == [None, None, 1000, 1000, 1000]
    assert tier.stored_size(b"b0") == 1000
    assert {t: n for t, (n, _) in tier.usage().items()} == {"a": 3, "b": 1}
    # The tenant is kept in each file: a restarted tier accounts them the same way.
    again = DiskTier(tmp_path, 1 << 20, limits=TenantLimits({"a": 3 * size}))
    assert again.usage() == tier.usage()
    buf = bytearray(1000)
    assert again.read_into(bytes([4]), bytearray(), memoryview(buf))
    assert bytes(buf) == bytes(payload(1000, 4))
