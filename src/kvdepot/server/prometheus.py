"""Prometheus exposition of the server's metrics (`kvdepot serve --metrics-port`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.core import Metric as PrometheusMetric

from kvdepot.metrics import BY_NAME, Kind


class StatsCollector:
    def __init__(self, read_stats: Callable[[], dict[str, float]]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterator[PrometheusMetric]:
        for name, value in sorted(self._read_stats().items()):
            metric = BY_NAME[name]
            family = CounterMetricFamily if metric.kind is Kind.COUNTER else GaugeMetricFamily
            yield family(f"kvdepot_{name}", metric.help, value=value)


def serve_metrics(host: str, port: int, read_stats: Callable[[], dict[str, float]]) -> None:
    registry = CollectorRegistry()
    registry.register(StatsCollector(read_stats))
    start_http_server(port, addr=host, registry=registry)
