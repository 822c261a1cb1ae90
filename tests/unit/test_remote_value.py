"""The shared tier's value format and `--remote` URLs (no server needed)."""

import itertools
import os

import pytest
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from kvdepot.storage.shared import value
from kvdepot.storage.shared.address import PASSWORD_VARIABLE, parse_shared_tier_url, with_secrets

KEY = bytes(range(34))


@pytest.mark.parametrize("payload_bytes,piece,pieces", [(1, 4, 1), (8, 4, 2), (9, 4, 3),
                                                        (0, 4, 1)])
def test_pieces_cover_the_payload(payload_bytes, piece, pieces):
    payload = memoryview(os.urandom(payload_bytes))
    encoded, count = value.encode_head(KEY, b"layout", payload, piece)
    head = value.decode_head(encoded)
    assert count == pieces and head is not None and head.pieces == pieces
    assert head.fingerprint == b"layout" and value.verify(KEY, head, payload)
    spans = [head.piece_span(i) for i in range(pieces)]
    assert spans[0][0] == 0 and spans[-1][1] == payload_bytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_every_change_fails_verification():
    payload = bytearray(os.urandom(1000))
    head = value.decode_head(value.encode_head(KEY, b"fp", memoryview(payload), 256)[0])
    assert value.verify(KEY, head, memoryview(payload))
    assert not value.verify(KEY[::-1], head, memoryview(payload))  # moved under another key
    payload[500] ^= 1
    assert not value.verify(KEY, head, memoryview(payload))


def test_pieces_are_checked_one_by_one_and_in_order():
    payload = bytearray(os.urandom(1000))
    head = value.decode_head(value.encode_head(KEY, b"fp", memoryview(payload), 256)[0])
    digests = [value.piece_digest(memoryview(payload)[start:start + 256])
               for start in range(0, 1000, 256)]
    assert value.verify_pieces(KEY, head, digests)
    assert not value.verify_pieces(KEY, head, [digests[1], digests[0], *digests[2:]])
    assert not value.verify_pieces(KEY, head, digests[:-1])
    swapped = payload[256:512] + payload[:256] + payload[512:]
    assert not value.verify(KEY, head, memoryview(swapped))


@pytest.mark.parametrize("cut", [0, 1, value.HEAD_BYTES - 1, value.HEAD_BYTES + 1])
def test_a_head_cut_short_or_of_another_format_is_refused(cut):
    encoded, _ = value.encode_head(KEY, b"fp", memoryview(b"x" * 10), 4)
    assert value.decode_head(encoded[:cut]) is None
    other = bytearray(encoded)
    other[4] = value.FORMAT + 1
    assert value.decode_head(bytes(other)) is None
    assert value.decode_head(b"XXXX" + encoded[4:]) is None


def test_keys_are_namespaced_by_format():
    assert value.head_key(KEY) == f"kvdepot:{value.FORMAT}:{KEY.hex()}"
    pieces = value.piece_keys(KEY, 2)
    assert [name.split("{")[0] for name in pieces] == [f"{value.head_key(KEY)}:0:",
                                                       f"{value.head_key(KEY)}:1:"]
    assert len(set(pieces)) == 2


@pytest.mark.parametrize("pieces", [1, 2, 3, 7, 8, 64])
@pytest.mark.parametrize("masters", [2, 3, 5, 6, 8])
def test_every_master_holds_its_share_of_a_chunks_pieces(pieces, masters):
    """A cluster's masters own contiguous, equal ranges of slots (as `redis-cli --cluster
    create` deals them): every master holds a chunk's pieces / masters of them, give or
    take one, wherever the chunk starts."""
    for key in [os.urandom(34) for _ in range(50)]:
        held = [0] * masters
        for name in value.piece_keys(key, pieces):
            held[key_slot(name.encode()) * masters // REDIS_CLUSTER_HASH_SLOTS] += 1
        assert max(held) - min(held) <= 1, held
        assert max(held) == -(-pieces // masters)


def test_piece_keys_start_at_the_heads_slot_and_differ_per_chunk():
    first, other = value.piece_keys(KEY, 4), value.piece_keys(KEY[::-1], 4)
    assert key_slot(first[0].encode()) == key_slot(value.head_key(KEY).encode())
    assert key_slot(other[0].encode()) == key_slot(value.head_key(KEY[::-1]).encode())
    assert not set(first) & set(other)


def test_urls():
    one = parse_shared_tier_url("redis://cache.example:6380/2")
    assert (one.nodes, one.cluster, one.tls, one.db) == ((("cache.example", 6380),), False,
                                                         False, 2)
    many = parse_shared_tier_url("rediss+cluster://acl-user@a:7000,b:7001")
    assert many.cluster and many.tls and many.username == "acl-user"
    assert many.nodes == (("a", 7000), ("b", 7001))
    assert many.display == "rediss+cluster://acl-user@a:7000,b:7001"


@pytest.mark.parametrize("url", ["http://a:1", "redis://a", "redis://a:0", "redis://a:b",
                                 "redis://a:1,b:2", "redis+cluster://a:1/3", "redis://a:1/x"])
def test_bad_urls_are_refused(url):
    with pytest.raises(ValueError, match="--shared-tier"):
        parse_shared_tier_url(url)


def test_a_password_in_the_url_is_refused_and_one_in_a_file_or_the_environment_used(
        tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="password on the command line"):
        parse_shared_tier_url("redis://user:secret@a:1")
    secret = tmp_path / "pw"
    secret.write_text("from-file\nignored\n")
    monkeypatch.setenv(PASSWORD_VARIABLE, "from-env")
    address = parse_shared_tier_url("redis://a:1")
    assert with_secrets(address, None, str(secret)).password == "from-file"
    assert with_secrets(address, "u", None).password == "from-env"
    assert with_secrets(address, "u", None).username == "u"
    assert "from-env" not in repr(with_secrets(address, "u", None))
    with pytest.raises(ValueError, match="cannot read"):
        with_secrets(address, None, str(tmp_path / "missing"))


def test_a_tier_derives_the_piece_placement_as_it_starts_not_on_its_first_read():
    from kvdepot.storage.shared.tier import SharedTier

    value._slot_tags.cache_clear()
    # Nothing listens there: the tier starts with its breaker open, placement ready.
    tier = SharedTier(parse_shared_tier_url("redis://127.0.0.1:1"), ttl=60, timeout=0.5,
                      piece_bytes=1 << 20)
    try:
        assert value._slot_tags.cache_info().currsize == 1
    finally:
        tier.close()


def test_the_password_variables_old_name_is_still_read(monkeypatch) -> None:
    from kvdepot.storage.shared.address import OLD_PASSWORD_VARIABLE

    monkeypatch.delenv(PASSWORD_VARIABLE, raising=False)
    monkeypatch.setenv(OLD_PASSWORD_VARIABLE, "old")
    assert with_secrets(parse_shared_tier_url("redis://a:1"), None, None).password == "old"
    monkeypatch.setenv(PASSWORD_VARIABLE, "new")  # the new name wins where both are set
    assert with_secrets(parse_shared_tier_url("redis://a:1"), None, None).password == "new"
