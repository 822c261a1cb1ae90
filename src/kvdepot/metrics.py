"""Every server metric, declared once with its kind and meaning.

STATS and the Prometheus exposition both read a `MetricsRegistry`; the storage tiers
and the data path bump the `Counter`s handed to them. Adding a metric is one row
in `METRICS`.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import NamedTuple


class Kind(enum.Enum):
    COUNTER = "counter"
    """Only grows while the server runs."""
    GAUGE = "gauge"
    """A current level, read when asked for."""


class Metric(NamedTuple):
    name: str
    kind: Kind
    help: str


METRICS: tuple[Metric, ...] = (
    Metric("lookups", Kind.COUNTER, "LOOKUP requests answered"),
    Metric("lookup_requested_tokens", Kind.COUNTER, "tokens sent in LOOKUP requests"),
    Metric("hit_chunks", Kind.COUNTER, "chunks found (and read-locked) by lookups"),
    Metric("hit_tokens", Kind.COUNTER, "tokens in the chunks and tails found by lookups"),
    Metric("hit_tails", Kind.COUNTER,
           "tails (a prompt's tokens past its last whole chunk) found by lookups"),
    Metric("hit_tail_tokens", Kind.COUNTER, "tokens in the tails found by lookups"),
    Metric("hit_states", Kind.COUNTER,
           "recurrent states (of hybrid models) that ended the hits of lookups"),
    Metric("hits_cut_to_state", Kind.COUNTER,
           "lookups of hybrid models whose held chunks went past the last held state, "
           "so the hit ended earlier"),
    Metric("stores", Kind.COUNTER, "STORE requests completed"),
    Metric("stored_chunks", Kind.COUNTER, "chunks copied into CPU memory by stores"),
    Metric("stored_tails", Kind.COUNTER, "tails copied into CPU memory by stores"),
    Metric("stored_states", Kind.COUNTER,
           "recurrent states (of hybrid models) copied into CPU memory by stores"),
    Metric("stored_bytes", Kind.COUNTER, "bytes copied into CPU memory by stores"),
    Metric("store_present_chunks", Kind.COUNTER,
           "chunks and tails a store named that were already held (nothing copied)"),
    Metric("store_skipped_full_chunks", Kind.COUNTER,
           "chunks and tails not stored because CPU memory was full of locked or in-flight "
           "chunks"),
    Metric("store_errors", Kind.COUNTER, "STORE requests that failed"),
    Metric("retrieves", Kind.COUNTER, "RETRIEVE requests completed"),
    Metric("retrieved_chunks", Kind.COUNTER, "chunks copied to engines by retrieves"),
    Metric("retrieved_tails", Kind.COUNTER, "tails copied to engines by retrieves"),
    Metric("retrieved_states", Kind.COUNTER,
           "recurrent states (of hybrid models) copied to engines by retrieves"),
    Metric("retrieved_tokens", Kind.COUNTER,
           "tokens whose KV retrieves wrote to engines (an engine counts these as loaded)"),
    Metric("retrieved_bytes", Kind.COUNTER, "bytes copied to engines by retrieves"),
    Metric("retrieve_errors", Kind.COUNTER, "RETRIEVE requests that failed"),
    Metric("retrieve_seconds", Kind.COUNTER,
           "seconds the server spent on completed RETRIEVE requests, from the request to "
           "its copies done on the engine's device (so retrieved_bytes over it is the rate "
           "an engine's loads get)"),
    Metric("block_allocation_reports", Kind.COUNTER, "block allocation records received"),
    Metric("expired_lookups", Kind.COUNTER,
           "lookups whose read locks were released after the lock TTL"),
    Metric("cancelled_operations", Kind.COUNTER,
           "stores and retrieves refused because the worker had given up on them (fence)"),
    Metric("reaped_engines", Kind.COUNTER,
           "registrations released because their worker process exited"),
    Metric("evictions", Kind.COUNTER, "chunks evicted from CPU memory to make room"),
    Metric("promoted_chunks", Kind.COUNTER, "chunks read up from lower tiers into CPU memory"),
    Metric("lower_tier_writes", Kind.COUNTER, "chunks written behind to the lower tiers"),
    Metric("lower_tier_dropped_writes", Kind.COUNTER,
           "chunks not written to a lower tier: its queue was full or it was unreachable"),
    Metric("lower_tier_discarded_chunks", Kind.COUNTER,
           "chunks a lower tier found damaged (checksum or length) and deleted unread"),
    Metric("shared_written_chunks", Kind.COUNTER, "chunks written to the shared tier"),
    Metric("shared_written_bytes", Kind.COUNTER, "payload bytes written to the shared tier"),
    Metric("shared_present_chunks", Kind.COUNTER,
           "chunks not written to the shared tier because it already held them"),
    Metric("shared_read_chunks", Kind.COUNTER, "chunks read from the shared tier, verified"),
    Metric("shared_read_bytes", Kind.COUNTER, "payload bytes read from the shared tier"),
    Metric("shared_read_seconds", Kind.COUNTER,
           "seconds spent reading from the shared tier, each read from its first command "
           "to its last reply (with shared_read_bytes: the rate promotions get)"),
    Metric("shared_discarded_chunks", Kind.COUNTER,
           "chunks in the shared tier found damaged, short or of another format, and deleted"),
    Metric("shared_dropped_writes", Kind.COUNTER,
           "chunks not written to the shared tier: it was unreachable or its queue was full"),
    Metric("shared_errors", Kind.COUNTER, "round trips to the shared tier that failed"),
    Metric("shared_breaker_opens", Kind.COUNTER,
           "times the shared tier's circuit breaker opened (the tier became unreachable)"),
    Metric("disk_skipped_slower_chunks", Kind.COUNTER,
           "chunks on disk a lookup left to its engine: loading them would have been slower "
           "than computing them"),
    Metric("shared_skipped_slower_chunks", Kind.COUNTER,
           "chunks in the shared tier a lookup left to its engine: loading them would have "
           "been slower than computing them"),
    Metric("lookups_refused", Kind.COUNTER,
           "lookups answered 0 because their connection had the most lookup jobs open"),
    Metric("lookups_lock_capped", Kind.COUNTER,
           "lookups that locked a shorter prefix: their connection held the most locked memory"),
    Metric("store_skipped_quota_chunks", Kind.COUNTER,
           "chunks and tails not stored because their tenant's quota was full of its own "
           "locked or in-flight chunks"),
    Metric("quota_evictions", Kind.COUNTER,
           "chunks evicted because their tenant's quota was lowered below its use"),
    Metric("lookups_refused_draining", Kind.COUNTER,
           "lookups answered 0 because the server was draining (shutting down)"),
    Metric("stores_refused_draining", Kind.COUNTER,
           "stores answered with nothing stored because the server was draining"),
    Metric("kv_events_published", Kind.COUNTER, "chunk notices published as KV events"),
    Metric("kv_events_dropped", Kind.COUNTER,
           "chunk notices dropped because the KV event queue was full"),
    Metric("block_events_dropped", Kind.COUNTER,
           "block events (vLLM block hashes stored or removed) an engine asked for after "
           "the server's bounded log had let them go"),
    Metric("http_connections_refused_peer", Kind.COUNTER,
           "HTTP connections (admin API, metrics) reset as accepted: their peer held the "
           "most a peer may"),
    Metric("http_connections_refused_all_peers", Kind.COUNTER,
           "HTTP connections (admin API, metrics) reset as accepted: the HTTP listeners "
           "held the most all peers may"),
    Metric("http_requests_timed_out", Kind.COUNTER,
           "HTTP connections reset because a request was not whole (headers and body) "
           "within the deadline"),
    Metric("http_requests_refused", Kind.COUNTER,
           "HTTP requests refused before reaching a handler: headers or body too large, a "
           "body without Content-Length, or not HTTP/1.1"),
    Metric("chunks", Kind.GAUGE, "chunks (and tails) held in CPU memory"),
    Metric("used_bytes", Kind.GAUGE, "bytes of CPU memory holding chunks"),
    Metric("tail_bytes", Kind.GAUGE, "bytes of CPU memory holding tails (part of used_bytes)"),
    Metric("capacity_bytes", Kind.GAUGE, "bytes of CPU memory for chunks"),
    Metric("locked_chunks", Kind.GAUGE, "chunks in CPU memory holding read locks"),
    Metric("lookup_jobs", Kind.GAUGE, "lookups whose locks are still held"),
    Metric("registered_engines", Kind.GAUGE, "engine workers with a registered KV cache"),
    Metric("chunk_size", Kind.GAUGE, "tokens per chunk"),
    Metric("block_hash_bytes", Kind.GAUGE,
           "bytes of vLLM block hashes kept with stored chunks, for block events"),
    Metric("transfers_in_flight", Kind.GAUGE,
           "stores, retrieves and registrations running or queued"),
    Metric("draining", Kind.GAUGE, "1 while the server drains before exiting, else 0"),
    Metric("shared_available", Kind.GAUGE,
           "1 while the shared tier's circuit breaker is closed, 0 while it is open"),
    Metric("shared_write_queue_chunks", Kind.GAUGE,
           "chunks waiting to be written to the shared tier: queued, or in the batch "
           "being written"),
)

RENAMED = {f"remote_{metric.name.removeprefix('shared_')}": metric.name
           for metric in METRICS if metric.name.startswith("shared_")}
"""Old name -> new name. The shared tier's metrics were called remote_* until the tier took
one name (2026-12-06); each old name is still reported, with its new name's value and
kind, for one release, so dashboards and alerts have that long to move (docs/server.md)."""
_CURRENT = {metric.name: metric for metric in METRICS}
METRICS += tuple(Metric(old, _CURRENT[new].kind,
                        f"{_CURRENT[new].help} (the old name of {new}, reported until the "
                        "next release)")
                 for old, new in RENAMED.items())
BY_NAME = {metric.name: metric for metric in METRICS}


class Counter:
    """A thread-safe, ever-growing count (or sum of seconds)."""

    def __init__(self) -> None:
        self._value: float = 0
        self._mutex = threading.Lock()

    def add(self, n: float = 1) -> None:
        with self._mutex:
            self._value += n

    @property
    def value(self) -> float:
        return self._value


class MetricsRegistry:
    """The server's metrics: a `Counter` per declared counter, a reader per gauge."""

    def __init__(self) -> None:
        self._counters = {m.name: Counter() for m in METRICS
                          if m.kind is Kind.COUNTER and m.name not in RENAMED}
        self._gauges: dict[str, Callable[[], float]] = {}

    def counter(self, name: str) -> Counter:
        return self._counters[RENAMED.get(name, name)]

    def add(self, **increments: int) -> None:
        for name, n in increments.items():
            self._counters[RENAMED.get(name, name)].add(n)

    def gauge(self, name: str, read: Callable[[], float]) -> None:
        name = RENAMED.get(name, name)
        if BY_NAME[name].kind is not Kind.GAUGE:
            raise ValueError(f"{name} is declared as a {BY_NAME[name].kind.value}, not a gauge")
        self._gauges[name] = read

    def counters(self) -> dict[str, float]:
        """The counters alone: no gauge is read (some walk every chunk)."""
        return _with_old_names({name: c.value for name, c in self._counters.items()})

    def snapshot(self) -> dict[str, float]:
        values = {name: float(c.value) for name, c in self._counters.items()}
        values.update((name, float(read())) for name, read in self._gauges.items())
        return _with_old_names(values)


def _with_old_names(values: dict[str, float]) -> dict[str, float]:
    """`values` with each renamed metric reported under its old name too (`RENAMED`)."""
    values.update((old, values[new]) for old, new in RENAMED.items() if new in values)
    return values
