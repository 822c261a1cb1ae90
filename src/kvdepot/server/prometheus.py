"""Prometheus exposition of the server's metrics (`kvdepot serve --metrics-port`)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

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


class KVGroupCollector:
    """What each registered engine's KV cache groups cost the cache (issue 44): per token
    (a sliding-window group beside a full one costs both, a chunk carrying every group),
    and per state for a recurrent group."""

    def __init__(self, read_engines: Callable[[], list[dict[str, Any]]]) -> None:
        self._read_engines = read_engines

    def collect(self) -> Iterator[PrometheusMetric]:
        family = GaugeMetricFamily(
            "kvdepot_kv_group_bytes_per_token",
            "bytes a token of one KV cache group of a registered engine takes in a chunk",
            labels=["engine", "model", "rank", "group"])
        states = GaugeMetricFamily(
            "kvdepot_kv_group_bytes_per_state",
            "bytes one recurrent state of one KV cache group of a registered engine takes "
            "(a hybrid model's Mamba-kind layers: one state is kept per chunk that ends in "
            "one)", labels=["engine", "model", "rank", "group"])
        for engine in self._read_engines():
            for group in engine["layout"]["groups"]:
                labels = [str(engine["engine"]), str(engine["model"]), str(engine["rank"]),
                          str(group["group"])]
                if "bytes_per_state" in group:
                    states.add_metric(labels, group["bytes_per_state"])
                else:
                    family.add_metric(labels, group["bytes_per_token"])
        yield family
        yield states


class MetricsServer:
    """`/metrics` on `host:port`, served like the admin API (uvicorn, within the HTTP
    bounds of `kvdepot.server.http_bounds`) rather than by prometheus_client's own
    server, which gives every connection a thread and keeps it as long as the client
    likes. Binds at once; serves from a thread until `stop()`."""

    def __init__(self, host: str, port: int, read_stats: Callable[[], dict[str, float]],
                 bounds: HttpBounds,
                 read_engines: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        registry = CollectorRegistry()
        registry.register(StatsCollector(read_stats))
        if read_engines is not None:
            registry.register(KVGroupCollector(read_engines))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host.strip("[]"), port), family=family)
        self.port = self._socket.getsockname()[1]
        self._server = BoundedHttpServer(make_asgi_app(registry), self._socket, bounds,
                                         "metrics")

    def stop(self) -> None:
        self._server.stop()
