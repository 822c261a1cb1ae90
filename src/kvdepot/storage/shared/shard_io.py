"""Commands sent to every master of the shared tier at once, big replies read in place.

redis-py's cluster pipeline sends every shard's commands and reads every shard's replies
from one thread, and hiredis turns each bulk reply into a `bytes` that the tier then
copies into CPU memory: a cluster read no faster than one shard (measured in
docs/shared-tier.md). Here each master's share goes out on that master's own connection
from a thread of its own, and a bulk reply whose length is the one expected is received
straight into its destination (`socket.recv_into` on the slice of the CPU pool it
belongs in), so a piece crosses memory once after the kernel's copy.

Two ways to drive the masters: `run_by_master` sends a batch and returns when every
master answered all of it (writes: a head may only follow its acknowledged pieces);
`stream_by_master` keeps a window of replies in flight on each master, sending the next
command as each reply lands, so no master waits for the slowest one between batches
(reads: their pieces are spread over the masters by hash, never evenly).

redis-py still does everything else: which master serves a key (the cluster client's
slot table), the connections (pooled, authenticated, TLS), command packing (the
zero-copy packer for big values). Our own protocol code is only the reply reader below,
and it understands only the replies these commands give: bulk strings, nil, integers,
simple strings and errors, in RESP2 or RESP3 (which redis-py 8 speaks by default). Any
error other than WRONGTYPE (MOVED, ASK, TRYAGAIN,
CLUSTERDOWN, a refused command) raises `Redirected`, and the caller redoes the work
through redis-py's pipeline, which follows redirections and reloads the topology.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

Command = tuple[Any, ...]
"""A command's arguments, name first."""
Job = tuple[str, Command, memoryview | None]
"""The key that routes a command, the command, and where its bulk reply goes (None:
a reply that is not a value: an integer, OK)."""

LINE_BUFFER_BYTES = 64 << 10
"""The buffer reply lines are read through: one system call brings many small replies,
and a bulk reply's first bytes that come with its line are copied from it (at most this
much per reply; the rest is received in place)."""
CRLF = b"\r\n"


class Redirected(Exception):
    """A master answered an error (MOVED, ASK, ...) that redis-py's pipeline handles:
    redo the batch there."""


def _pool_of(client: Any, key: str) -> Any:
    """The connection pool of the master that serves `key` (a standalone client has
    one)."""
    if hasattr(client, "get_node_from_key"):
        return client.get_redis_connection(client.get_node_from_key(key)).connection_pool
    return client.connection_pool


def _connections(client: Any, jobs: Sequence[Job], connections_per_master: int
                 ) -> list[tuple[Any, list[int]]]:
    """The jobs (their indices, in order) of each connection: every master's dealt out
    over `connections_per_master` of its pool's connections."""
    by_pool: dict[int, tuple[Any, list[int]]] = {}
    for index, (key, _, _) in enumerate(jobs):
        pool = _pool_of(client, key)
        by_pool.setdefault(id(pool), (pool, []))[1].append(index)
    return [(pool, indices[share::connections_per_master])
            for pool, indices in by_pool.values()
            for share in range(min(connections_per_master, len(indices)))]


def _wait_all(futures: Sequence[Future[Any]]) -> None:
    """Returns once every thread is done with its destinations; raises the first
    connection failure, else `Redirected` if a master redirected."""
    wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    failures = [e for e in errors if not isinstance(e, Redirected)]
    if failures or errors:
        raise (failures or errors)[0]  # type: ignore[misc]


def run_by_master(executor: ThreadPoolExecutor, client: Any, jobs: Sequence[Job],
                  connections_per_master: int = 1) -> list[bool]:
    """Each job's outcome (False: its key held no value, a value of another length than
    its destination, or another type), every master's jobs on its own connections (its
    jobs dealt out over `connections_per_master` of them) and threads. Returns only when
    every thread is done with the destinations; raises the first connection failure,
    else `Redirected` if a master redirected."""
    outcome = [False] * len(jobs)
    groups = _connections(client, jobs, connections_per_master)
    if len(groups) == 1:  # one connection: no thread to hand over to
        pool, indices = groups[0]
        for index, good in zip(indices, _on_master(pool, [jobs[i] for i in indices]),
                               strict=True):
            outcome[index] = good
        return outcome
    futures: list[Future[list[bool]]] = [
        executor.submit(_on_master, pool, [jobs[i] for i in indices]) for pool, indices in groups]
    _wait_all(futures)
    for (_, indices), future in zip(groups, futures, strict=True):
        for index, good in zip(indices, future.result(), strict=True):
            outcome[index] = good
    return outcome


class Cutoff:
    """The first job index not to send, shared by every master's thread of a stream:
    anyone may lower it (a chunk that cannot complete makes the jobs after it
    worthless)."""

    def __init__(self, end: int) -> None:
        self._mutex = threading.Lock()
        self.index = end

    def lower(self, index: int) -> None:
        with self._mutex:
            self.index = min(self.index, index)


def stream_by_master(executor: ThreadPoolExecutor, client: Any, jobs: Sequence[Job],
                     window_bytes: int, on_reply: Callable[[int, bool], None],
                     cutoff: Cutoff, connections_per_master: int = 1) -> None:
    """Every job sent and its reply read, every master's share on its own connections and
    threads, each keeping about `window_bytes` of expected values in flight (at least one
    command): the master always has the next command when it finishes a reply, and
    holds no more than the window in its output buffer. `on_reply(index, good)` runs on
    the master's thread as each reply lands (`good` as in `run_by_master`). Jobs at or
    past `cutoff.index` when their turn comes are not sent; a connection that fails
    lowers the cutoff to its first job without a reply. Returns only when every thread
    is done with the destinations; raises as `run_by_master`."""
    groups = _connections(client, jobs, connections_per_master)
    _wait_all([executor.submit(_stream_on_master, pool, jobs, indices, window_bytes, on_reply,
                               cutoff) for pool, indices in groups])


def _stream_on_master(pool: Any, jobs: Sequence[Job], indices: list[int], window_bytes: int,
                      on_reply: Callable[[int, bool], None], cutoff: Cutoff) -> None:
    connection = pool.get_connection()
    in_flight: deque[int] = deque()
    unsent = deque(indices)
    try:
        replies = Replies(connection._sock)
        in_flight_bytes = 0
        while True:
            sending = []
            while unsent and unsent[0] < cutoff.index and (
                    in_flight_bytes < window_bytes or not in_flight):
                index = unsent.popleft()
                sending.append(jobs[index][1])
                in_flight.append(index)
                in_flight_bytes += _value_bytes(jobs[index])
            if sending:
                connection.send_packed_command(connection.pack_commands(sending),
                                               check_health=False)
            if not in_flight:
                break
            index = in_flight[0]
            good = replies.into(jobs[index][2])
            in_flight.popleft()
            in_flight_bytes -= _value_bytes(jobs[index])
            on_reply(index, good)
        replies.finish()
    except BaseException:
        connection.disconnect()
        if in_flight or unsent:
            cutoff.lower((in_flight or unsent)[0])
        raise
    finally:
        pool.release(connection)


def _value_bytes(job: Job) -> int:
    """What a job counts against a window: its value, at least a byte (a window of one
    byte is one command at a time)."""
    return 1 if job[2] is None else max(1, len(job[2]))


def _on_master(pool: Any, jobs: list[Job]) -> list[bool]:
    """One master's jobs: every command sent (big values straight from the caller's
    memory), then every reply read. A connection that failed or was left mid-reply is
    closed, never reused."""
    connection = pool.get_connection()
    try:
        connection.send_packed_command(connection.pack_commands([c for _, c, _ in jobs]),
                                       check_health=False)
        replies = Replies(connection._sock)
        outcome = [replies.into(target) for _, _, target in jobs]
        replies.finish()
        return outcome
    except BaseException:
        connection.disconnect()
        raise
    finally:
        pool.release(connection)


class Replies:
    """RESP2/RESP3 replies from a socket, bulk strings received into the caller's
    buffers."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buffer = bytearray(LINE_BUFFER_BYTES)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0
        self._redirect: str | None = None

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):
            kept = self._end - self._start
            self._buffer[:kept] = self._buffer[self._start:self._end]
            self._start, self._end = 0, kept
        received = self._sock.recv_into(self._view[self._end:])
        if not received:
            raise RedisConnectionError("the server closed the connection mid-reply")
        self._end += received

    def _line(self) -> bytes:
        while True:
            at = self._buffer.find(CRLF, self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start:at])
                self._start = at + 2
                return line
            if self._start == 0 and self._end == len(self._buffer):
                raise RedisConnectionError("a reply line longer than the line buffer")
            self._fill()

    def _exact(self, target: memoryview) -> None:
        """len(target) bytes: those already buffered, the rest straight from the socket."""
        have = min(self._end - self._start, len(target))
        target[:have] = self._view[self._start:self._start + have]
        self._start += have
        got = have
        while got < len(target):
            received = self._sock.recv_into(target[got:])
            if not received:
                raise RedisConnectionError("the server closed the connection mid-reply")
            got += received

    def _skip(self, count: int) -> None:
        scratch = memoryview(bytearray(min(count, 1 << 20)))
        while count:
            part = scratch[:min(count, len(scratch))]
            self._exact(part)
            count -= len(part)

    def into(self, target: memoryview | None) -> bool:
        """The next reply; a bulk string of `target`'s length lands in `target`. False:
        nil, WRONGTYPE, or a value of another length (drained, not kept)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            length = int(rest)
            if length < 0:
                return False
            if target is None or length != len(target):
                self._skip(length + 2)
                return False
            self._exact(target)
            end = memoryview(bytearray(2))
            self._exact(end)
            if end != CRLF:
                raise RedisConnectionError("a bulk reply not followed by CRLF")
            return True
        if kind == b"_":  # RESP3's null
            return False
        if kind in (b":", b"+", b"#", b","):  # EXPIRE's integer, SET's OK
            return True
        if kind == b"!":  # RESP3's error of a given length
            message = memoryview(bytearray(int(rest) + 2))
            self._exact(message)
            kind, rest = b"-", bytes(message[:-2])
        if kind == b"-":
            if rest.startswith(b"WRONGTYPE"):
                return False
            # Read the rest of the replies first (the connection stays in step), then
            # hand the batch to redis-py.
            self._redirect = self._redirect or rest.decode(errors="replace")
            return False
        raise RedisConnectionError(f"an unexpected reply type {kind!r}")

    def finish(self) -> None:
        """Every reply read: nothing may be left over (it would be a desynchronised
        connection); then a redirection, if one came, raises."""
        if self._start != self._end:
            raise RedisConnectionError("bytes left after the last reply")
        if self._redirect is not None:
            raise Redirected(self._redirect)

