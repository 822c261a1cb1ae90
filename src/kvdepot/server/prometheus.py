"""Prometheus exposition of the server's metrics (`kvdepot serve --metrics-port`)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.core import Metric as PrometheusMetric

from kvdepot.metrics import BY_NAME, Kind
from kvdepot.server.http_bounds import BoundedHttpServer, HttpBounds


class StatsCollector:
    def __init__(self, read_stats: Callable[[], dict[str, float]]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterator[PrometheusMetric]:
        for name, value in sorted(self._read_stats().items()):
            metric = BY_NAME[name]
            family = CounterMetricFamily if metric.kind is Kind.COUNTER else GaugeMetricFamily
            yield family(f"kvdepot_{name}", metric.help, value=value)


class MetricsServer:
    """`/metrics` on `host:port`, served like the admin API (uvicorn, within the HTTP
    bounds of `kvdepot.server.http_bounds`) rather than by prometheus_client's own
    server, which gives every connection a thread and keeps it as long as the client
    likes. Binds at once; serves from a thread until `stop()`."""

    def __init__(self, host: str, port: int, read_stats: Callable[[], dict[str, float]],
                 bounds: HttpBounds) -> None:
        registry = CollectorRegistry()
        registry.register(StatsCollector(read_stats))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host.strip("[]"), port), family=family)
        self.port = self._socket.getsockname()[1]
        self._server = BoundedHttpServer(make_asgi_app(registry), self._socket, bounds,
                                         "metrics")

    def stop(self) -> None:
        self._server.stop()
