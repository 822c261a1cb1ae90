"""The shared tier's reply reader (`shard_io.Replies`) on replies cut at every byte:
bulk values land in their buffers, nil / WRONGTYPE / another length are misses that
keep the connection in step, redirections are raised only after every reply was read,
and a desynchronised or closed connection raises; a big value from a real socket lands
whole (from a blocking socket too), one that stalls times out, and a signal mid-value
neither loses nor repeats a byte."""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from kvdepot.storage.shared.shard_io import Redirected, Replies


class Trickle:
    """A socket that hands out its bytes `step` at a time."""

    def __init__(self, data: bytes, step: int) -> None:
        self._data, self._step, self._at = data, step, 0

    def recv_into(self, target: memoryview) -> int:
        part = self._data[self._at:self._at + min(self._step, len(target))]
        target[:len(part)] = part
        self._at += len(part)
        return len(part)


VALUE = bytes(range(256)) * 40 + b"\r\n$-1"  # a payload that looks like protocol inside


@pytest.mark.parametrize("step", [1, 7, 4096, 1 << 20])
def test_values_land_in_place_and_misses_keep_the_connection_in_step(step):
    stream = (b"$%d\r\n" % len(VALUE) + VALUE + b"\r\n"   # the value
              + b"$-1\r\n" + b"_\r\n"                      # nil, RESP2 and RESP3
              + b"-WRONGTYPE Operation against a key\r\n"
              + b"$3\r\nabc\r\n"                           # another length: drained
              + b":1\r\n+OK\r\n"
              + b"$%d\r\n" % len(VALUE) + VALUE + b"\r\n")
    replies = Replies(Trickle(stream, step))
    first, last = bytearray(len(VALUE)), bytearray(len(VALUE))
    got = [replies.into(memoryview(first)), replies.into(memoryview(bytearray(8))),
           replies.into(None), replies.into(memoryview(bytearray(8))),
           replies.into(memoryview(bytearray(8))), replies.into(None), replies.into(None),
           replies.into(memoryview(last))]
    replies.finish()
    assert got == [True, False, False, False, False, True, True, True]
    assert bytes(first) == VALUE and bytes(last) == VALUE


def test_a_redirection_is_raised_once_every_reply_was_read():
    replies = Replies(Trickle(b"-MOVED 3999 127.0.0.1:6381\r\n$2\r\nok\r\n", 5))
    assert replies.into(memoryview(bytearray(2))) is False
    assert replies.into(memoryview(bytearray(2))) is True
    with pytest.raises(Redirected, match="MOVED"):
        replies.finish()


@pytest.mark.parametrize("stream, length", [(b"$5\r\nabc", 5), (b"$3\r\nabcXY", 3),
                                            (b"*1\r\n", 3)],
                         ids=["closed-mid-value", "no-crlf-after-value", "unexpected-type"])
def test_a_broken_stream_raises(stream, length):
    replies = Replies(Trickle(stream, 3))
    with pytest.raises(RedisConnectionError):
        replies.into(memoryview(bytearray(length)))


def test_bytes_left_after_the_last_reply_raise():
    replies = Replies(Trickle(b"+OK\r\n+OK\r\n", 1 << 10))
    assert replies.into(None)
    with pytest.raises(RedisConnectionError):
        replies.finish()


# ---- big values from a real socket, bounded by its timeout ---------------------------------
BIG = bytes(range(251)) * (5 << 12)  # about 5 MiB, not a page multiple


def _sender(sock: socket.socket, parts: list[bytes], pause: float, close: bool = False
            ) -> threading.Thread:
    def send() -> None:
        for part in parts:
            sock.sendall(part)
            time.sleep(pause)
        if close:
            sock.close()
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("timeout", [5.0, None], ids=["timeout", "blocking"])
def test_a_big_value_sent_in_bits_lands_whole(timeout):
    ours, theirs = socket.socketpair()
    ours.settimeout(timeout)
    stream = b"$%d\r\n" % len(BIG) + BIG + b"\r\n" + b"$3\r\nabc\r\n"
    bits = [stream[i:i + 300_001] for i in range(0, len(stream), 300_001)]
    sender = _sender(theirs, bits, 0.002)
    replies = Replies(ours)
    big, small = bytearray(len(BIG)), bytearray(3)
    assert replies.into(memoryview(big)) and replies.into(memoryview(small))
    replies.finish()
    assert bytes(big) == BIG and bytes(small) == b"abc"
    sender.join()
    ours.close()
    theirs.close()


def test_a_server_that_stalls_mid_value_times_out_instead_of_hanging():
    ours, theirs = socket.socketpair()
    ours.settimeout(0.2)
    _sender(theirs, [b"$%d\r\n" % len(BIG) + BIG[:len(BIG) // 2]], 0)
    with pytest.raises(TimeoutError):  # an OSError: the tier's breaker opens
        Replies(ours).into(memoryview(bytearray(len(BIG))))
    ours.close()
    theirs.close()


def test_a_server_that_closes_mid_value_raises():
    ours, theirs = socket.socketpair()
    ours.settimeout(5)
    _sender(theirs, [b"$%d\r\n" % len(BIG) + BIG[:len(BIG) // 3]], 0, close=True)
    with pytest.raises(RedisConnectionError, match="closed"):
        Replies(ours).into(memoryview(bytearray(len(BIG))))
    ours.close()


def test_a_signal_mid_value_runs_its_handler_and_the_value_still_lands():
    """A signal while the receive waits: its Python handler runs, and the receive goes
    on where it stopped."""
    ours, theirs = socket.socketpair()
    ours.settimeout(5)
    stream = b"$%d\r\n" % len(BIG) + BIG + b"\r\n"
    handled = []
    previous = signal.signal(signal.SIGALRM, lambda *_: handled.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)  # fires while the sender pauses
        sender = _sender(theirs, [stream[:len(stream) // 2], stream[len(stream) // 2:]], 0.3)
        big = bytearray(len(BIG))
        assert Replies(ours).into(memoryview(big))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert handled and bytes(big) == BIG
    sender.join()
    ours.close()
    theirs.close()
