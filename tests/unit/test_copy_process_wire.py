"""The framing between the server and a GPU's copy process (transfer/copy_process/wire)."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from kvdepot.transfer.copy_process import wire


def channel_pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def test_a_copy_request_arrives_whole_however_the_bytes_are_split() -> None:
    """One message carries every KV cache group of an operation."""
    ours, theirs = channel_pair()
    ids = np.arange(100_000, dtype=np.int64)  # larger than one socket buffer
    groups = [wire.GroupCopy(group=0, block_ids=ids.tobytes(), first_slot=0,
                             chunk_offsets=np.array([0, 8192]).tobytes(), chunk_bytes=4096),
              wire.GroupCopy(group=1, block_ids=ids[::-1].tobytes(), first_slot=2,
                             chunk_offsets=np.array([4096, 12288]).tobytes(), chunk_bytes=4096)]
    sent = wire.Copy(engine=3, to_host=True, blocks_per_chunk=16, groups=groups,
                     event_handle=b"\1" * 64)
    sender = threading.Thread(target=wire.send, args=(ours, sent))
    sender.start()
    got = wire.REQUESTS.decode(wire.receive(theirs))
    sender.join()
    assert got == sent
    assert [g.group for g in got.groups] == [0, 1]
    assert np.array_equal(np.frombuffer(got.groups[1].block_ids, dtype=np.int64), ids[::-1])


def test_a_reply_longer_than_allowed_is_refused_before_it_is_read() -> None:
    ours, theirs = channel_pair()
    wire.send(ours, wire.Outcome(2, "x" * 5000))
    with pytest.raises(wire.ChannelClosed, match="longer than the 1000 allowed"):
        wire.receive(theirs, limit=1000)


def test_a_channel_closed_in_the_middle_of_a_message_is_reported() -> None:
    ours, theirs = channel_pair()
    ours.sendall(b"\x10\x00\x00\x00abc")  # says 16 bytes, sends 3
    ours.close()
    with pytest.raises(wire.ChannelClosed):
        wire.receive(theirs)
