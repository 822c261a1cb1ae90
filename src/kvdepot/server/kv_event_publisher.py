"""Publishing KV events (`--kv-events`): a ZeroMQ PUB socket, and a ROUTER socket that
replays recent batches to a subscriber that starts late or missed some.

The tiers tell the publisher of every chunk that enters or leaves them (`TierListener`),
under their own mutex and on whatever thread changed them (the control thread too): the
publisher only appends a tuple to a bounded list. Its own thread turns the list into
events every `BATCH_INTERVAL`, numbers the batch, publishes it and keeps it for replay.
Past `MAX_PENDING` chunks waiting, new ones are dropped and counted (`kv_events_dropped`,
and the next batch's `dropped`), so a stalled publisher never slows the server.

Wire format and replay protocol: `kvdepot.kv_event_wire` and docs/kv-events.md.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import zmq

from kvdepot.errors import AddressInUse
from kvdepot.keys import HASH_BYTES, ChunkKey, key_rank
from kvdepot.kv_event_wire import (
    ALL_TIERS,
    ENCODER,
    REPLAY_END,
    SEQUENCE,
    TOPIC,
    AllChunksCleared,
    ChunkRemoved,
    ChunkStored,
    EventBatch,
    KVEvent,
)
from kvdepot.metrics import Counter
from kvdepot.rpc.auth import EVENTS_ZAP_DOMAIN, ServerAuth
from kvdepot.rpc.connection_guard import ConnectionGuard, harden
from kvdepot.storage.chunk import ChunkScope

log = logging.getLogger(__name__)

BATCH_INTERVAL = 0.01
"""Seconds between batches while events arrive."""
MAX_PENDING = 262144
"""Chunks waiting to be published; past it new ones are dropped and counted."""
REPLAY_BYTES = 64 << 20
"""Encoded batches kept for replay, newest first; older ones are forgotten."""

_Pending = tuple[Any, ...]


def replay_url_for(url: str) -> str:
    """The replay socket's default address: the event socket's port plus one."""
    base, _, port = url.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"--kv-events must be tcp://HOST:PORT, got {url!r}")
    return f"{base}:{int(port) + 1}"


class KVEventPublisher:
    """A `TierListener` that publishes what it hears."""

    def __init__(self, url: str, replay_url: str, tokens_per_chunk: int,
                 auth: ServerAuth | None = None, context: zmq.Context | None = None,
                 published: Counter | None = None, dropped: Counter | None = None) -> None:
        self.url = url
        self.replay_url = replay_url
        self._tokens = tokens_per_chunk
        self.published = published or Counter()
        self.dropped = dropped or Counter()
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay = ctx.socket(zmq.ROUTER)
        for sock, where in ((self._pub, url), (self._replay, replay_url)):
            sock.setsockopt(zmq.LINGER, 0)
            harden(sock)  # never-handshaking subscribers are dropped (connection_guard)
            if auth is not None and auth.enabled:
                auth.configure(sock, EVENTS_ZAP_DOMAIN)
            try:
                sock.bind(where)
            except zmq.ZMQError as exc:
                self._pub.close(linger=0)
                self._replay.close(linger=0)
                raise AddressInUse(f"cannot publish KV events on {where}: {exc}") from None
        # Subscribers' connections count against their peer's bound with its requests'.
        self._guards = [ConnectionGuard(self._pub, "KV-event"),
                        ConnectionGuard(self._replay, "KV-event replay")]
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._pending_chunks = 0
        self._dropped_since = 0
        self._sequence = 0
        self._history: collections.deque[tuple[int, bytes]] = collections.deque()
        self._history_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvdepot-kv-events", daemon=True)

    def start(self) -> None:
        """Begin with `AllChunksCleared` for every tier: a subscriber forgets what an
        earlier run of this server told it."""
        self.cleared(ALL_TIERS)
        self._thread.start()

    # ---- TierListener (any thread, under a tier's mutex: append and return) -------------
    def stored(self, tier: str, key: ChunkKey, scope: ChunkScope, parent: bytes | None
               ) -> None:
        self._add(("s", tier, key, scope, parent), 1)

    def removed(self, tier: str, chunks: list[tuple[ChunkKey, str]]) -> None:
        self._add(("r", tier, chunks), len(chunks))

    def cleared(self, tier: str) -> None:
        self._add(("c", tier), 1)

    def _add(self, item: _Pending, chunks: int) -> None:
        with self._lock:
            if self._pending_chunks + chunks > MAX_PENDING:
                self._dropped_since += chunks
                self.dropped.add(chunks)
                return
            self._pending.append(item)
            self._pending_chunks += chunks

    # ---- the publisher's thread -------------------------------------------------------
    def close(self) -> None:
        """Publish what is pending and stop."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        else:
            self._close_sockets(linger=0)
        for guard in self._guards:  # their sockets are closed: they end now
            guard.stop()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(int(BATCH_INTERVAL * 1000)):
                    self._serve_replays()
                self._publish_pending()
            self._publish_pending()
        except Exception:
            log.exception("the KV event publisher failed; no more events are published")
        finally:
            self._close_sockets(linger=100)

    def _close_sockets(self, linger: int) -> None:
        """The last events may take `linger` ms to leave; the replay socket closes at once."""
        publisher, replay = self._guards
        publisher.close_socket(linger)
        replay.close_socket(0)

    def _publish_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            dropped, self._dropped_since = self._dropped_since, 0
            self._pending_chunks = 0
        if not pending and not dropped:
            return
        payload = ENCODER.encode(EventBatch(time.time(), self._events(pending), dropped))
        sequence = SEQUENCE.pack(self._sequence)
        self._sequence += 1
        self._pub.send_multipart([TOPIC, sequence, payload], copy=False)
        self.published.add(len(pending))
        self._history.append((self._sequence - 1, payload))
        self._history_bytes += len(payload)
        while self._history_bytes > REPLAY_BYTES and len(self._history) > 1:
            self._history_bytes -= len(self._history.popleft()[1])

    def _events(self, pending: list[_Pending]) -> list[KVEvent]:
        """One event per run: consecutive chunks of one prompt make one ChunkStored,
        removals one ChunkRemoved per (tier, rank, tenant) of each notice."""
        events: list[KVEvent] = []
        run: list[Any] | None = None  # [tier, rank, scope, parent, hashes]

        def close_run() -> None:
            if run is not None:
                tier, rank, scope, parent, hashes = run
                events.append(ChunkStored(hashes, parent, self._tokens, tier, rank,
                                          scope.tenant, scope.model))

        for item in pending:
            if item[0] == "s":
                _, tier, key, scope, parent = item
                chain, rank = key[:HASH_BYTES], key_rank(key)
                if (run is not None and run[0] == tier and run[1] == rank and run[2] == scope
                        and run[4][-1] == parent):
                    run[4].append(chain)
                    continue
                close_run()
                run = [tier, rank, scope, parent, [chain]]
                continue
            close_run()
            run = None
            if item[0] == "r":
                groups: dict[tuple[int, str], list[bytes]] = {}
                for key, tenant in item[2]:
                    groups.setdefault((key_rank(key), tenant), []).append(key[:HASH_BYTES])
                events.extend(ChunkRemoved(hashes, item[1], rank, tenant)
                              for (rank, tenant), hashes in groups.items())
            else:
                events.append(AllChunksCleared(item[1]))
        close_run()
        return events

    def _serve_replays(self) -> None:
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer = frames[0]
            start = (SEQUENCE.unpack(frames[-1])[0]
                     if len(frames) >= 2 and len(frames[-1]) == SEQUENCE.size else None)
            if start is not None:
                for sequence, payload in list(self._history):
                    if sequence >= start:
                        self._replay.send_multipart([peer, SEQUENCE.pack(sequence), payload])
            self._replay.send_multipart([peer, SEQUENCE.pack(REPLAY_END), b""])
