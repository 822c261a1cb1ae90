"""Every declared metric reaches STATS and Prometheus, with its kind and help text."""

from __future__ import annotations

import threading

import pytest

from kvdepot.metrics import METRICS, Counter, Kind, MetricsRegistry
from kvdepot.options import DEFAULTS
from kvdepot.protocol import Empty, RequestType
from kvdepot.server.depot import Depot
from kvdepot.server.prometheus import StatsCollector
from tests.unit.support.depot import OWNER


def test_stats_reports_every_declared_metric(depot: Depot) -> None:
    values = depot.handle(RequestType.STATS, Empty(), OWNER).values
    assert set(values) == {m.name for m in METRICS}
    assert values["chunk_size"] == DEFAULTS.chunk_size
    assert values["capacity_bytes"] == depot.tier.capacity


def test_evictions_reach_stats_through_the_tiers_counter(depot: Depot) -> None:
    for key in (b"a", b"b", b"c"):
        _, chunk = depot.tier.reserve(key, 512 << 10, b"")
        if chunk is not None:
            depot.tier.commit(chunk)
    assert depot.handle(RequestType.STATS, Empty(), OWNER).values["evictions"] == 1


def test_prometheus_kind_and_help_come_from_the_declaration(depot: Depot) -> None:
    families = {f.name: f for f in StatsCollector(depot.metrics.snapshot).collect()}
    for metric in METRICS:
        # prometheus_client strips a counter's _total suffix; none of ours has one.
        family = families[f"kvdepot_{metric.name}"]
        assert family.type == metric.kind.value
        assert family.documentation == metric.help
        assert metric.help != f"kvdepot {metric.name}"


def test_an_undeclared_metric_is_refused() -> None:
    registry = MetricsRegistry()
    with pytest.raises(KeyError):
        registry.add(not_a_metric=1)
    with pytest.raises(ValueError):
        registry.gauge("lookups", lambda: 0.0)
    assert {m.kind for m in METRICS} == set(Kind)


def test_counter_loses_no_increment_across_threads() -> None:
    counter = Counter()

    def bump() -> None:
        for _ in range(20_000):
            counter.add()

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.value == 80_000


def test_the_shared_tiers_old_metric_names_report_the_new_ones(depot: Depot) -> None:
    from kvdepot.metrics import RENAMED

    assert RENAMED["remote_read_bytes"] == "shared_read_bytes"
    assert RENAMED["remote_available"] == "shared_available"
    assert len(RENAMED) == 13
    depot.metrics.add(shared_read_bytes=5)
    depot.metrics.counter("remote_errors").add(2)  # an old name reaches the new counter
    values = depot.handle(RequestType.STATS, Empty(), OWNER).values
    for old, new in RENAMED.items():
        assert values[old] == values[new]
    assert values["remote_read_bytes"] == 5 and values["shared_errors"] == 2
    families = {f.name: f for f in StatsCollector(depot.metrics.snapshot).collect()}
    assert families["kvdepot_remote_read_bytes"].samples[0].value == 5
    assert families["kvdepot_shared_read_bytes"].samples[0].value == 5
