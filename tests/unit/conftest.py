"""A depot without sockets, for unit tests of request handling."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvdepot.metrics import MetricsRegistry
from kvdepot.options import DEFAULTS
from kvdepot.server.assembly import assemble_depot
from kvdepot.server.depot import Depot
from kvdepot.storage.cpu_tier import CPUTier


@pytest.fixture
def depot() -> Iterator[Depot]:
    metrics = MetricsRegistry()
    tier = CPUTier(torch.zeros(1 << 20, dtype=torch.uint8), evictions=metrics.counter("evictions"))
    depot = assemble_depot(DEFAULTS.resolved(copy_processes=False), tier, metrics)
    yield depot
    depot.close()
