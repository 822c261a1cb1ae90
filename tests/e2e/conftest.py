"""The end-to-end suite's fixtures: the model, a log folder per module, and kvdepot
servers. What the tests share besides is in tests/e2e/support/ (harness.py). Without vLLM
the whole suite is skipped."""

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvdepot.testbed.checkpoint import seeded_checkpoint
from tests.e2e.support.harness import LOCK_TTL_S, MODEL_CONFIG, DepotServer


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return seeded_checkpoint(MODEL_CONFIG)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def server(log_dir: Path) -> Iterator[DepotServer]:
    depot = DepotServer(log_dir)
    depot.start()
    yield depot
    depot.kill()


@pytest.fixture(scope="module")
def short_lock_server(log_dir: Path) -> Iterator[DepotServer]:
    """A server whose lookup locks expire after LOCK_TTL_S (a module that needs it makes
    it its `server`)."""
    depot = DepotServer(log_dir, lock_ttl=LOCK_TTL_S)
    depot.start()
    yield depot
    depot.kill()
