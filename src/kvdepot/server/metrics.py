"""Prometheus exposition of the server's counters (`kvdepot serve --metrics-port`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# Values that go up and down; every other STATS value only grows.
_GAUGES = frozenset({"chunks", "used_bytes", "capacity_bytes", "locked_chunks", "lookup_jobs",
                     "registered_engines", "chunk_size"})


class StatsCollector:
    def __init__(self, read_stats: Callable[[], dict[str, float]]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        for name, value in sorted(self._read_stats().items()):
            if name in _GAUGES:
                yield GaugeMetricFamily(f"kvdepot_{name}", f"kvdepot {name}", value=value)
            else:
                yield CounterMetricFamily(f"kvdepot_{name}", f"kvdepot {name}", value=value)


def serve_metrics(host: str, port: int, read_stats: Callable[[], dict[str, float]]) -> None:
    registry = CollectorRegistry()
    registry.register(StatsCollector(read_stats))
    start_http_server(port, addr=host, registry=registry)
