"""GPU tests: a real `kvdepot serve` process and engine processes on one CUDA device."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvdepot.testbed.server_process import ServerProcess
from tests.gpu.support.depot_server import start_server

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="module", params=["auto", "dma", "batch", "kernel", "kernel-pieces"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    """A server per copy mode, so the DMA, the batched-DMA and the staged-kernel path see
    every test; `kernel-pieces` stages every chunk as a piece of its own, so the two
    staging buffers and streams per direction take turns within each operation too."""
    mode, _, variant = request.param.partition("-")
    env = {"KVDEPOT_CUDA_STAGING": "1"} if variant == "pieces" else {}
    srv = start_server(mode, tmp_path_factory.mktemp("server") / "server.log", env)
    yield srv
    assert srv.alive(), "the kvdepot server died during the tests"
    srv.stop()
