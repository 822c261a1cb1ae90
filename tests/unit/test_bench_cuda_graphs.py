"""`kvdepot bench e2e --device cuda` and its `--eager`, the parts that need no GPU: the
engines are built as vLLM builds them by default on a GPU (compiled, CUDA graphs captured)
unless `--eager` asks otherwise, every engine of the run alike, and the header says which.
The engines themselves:
`tests/gpu/test_vllm_gpu.py::test_under_cuda_graphs_a_kvdepot_hit_is_vllms_own_hit`."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvdepot.bench import e2e_gpu


def _args(*words: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    e2e_gpu.add_arguments(p)
    return p.parse_args(list(words))


@pytest.mark.parametrize("engine", ["none", "noop", "kvdepot", "offload"])
def test_every_engine_runs_with_cuda_graphs_unless_eager_is_asked_for(engine: str) -> None:
    pytest.importorskip("vllm")
    url = "tcp://127.0.0.1:1" if engine == "kvdepot" else None
    eager = e2e_gpu.llm_options(Path("/m"), engine, url, 4096, _args("--eager"))
    graphs = e2e_gpu.llm_options(Path("/m"), engine, url, 4096, _args())
    assert eager["enforce_eager"] is True and graphs["enforce_eager"] is False
    # Nothing else differs, and the engine's own options are in both.
    assert eager.keys() == graphs.keys()
    assert e2e_gpu.engine_options(engine, url, _args()).keys() <= graphs.keys()
    assert all(eager[k] == graphs[k] for k in eager
               if k not in ("enforce_eager", "kv_transfer_config"))


def test_the_header_names_the_mode() -> None:
    assert e2e_gpu.execution_mode(_args("--eager")) == "eager"
    assert e2e_gpu.execution_mode(_args()) == "compiled with CUDA graphs"


def test_the_command_takes_the_option() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = subprocess.run([sys.executable, "-m", "kvdepot.cli", "bench", "e2e", "--device",
                          "cuda", "--eager", "--engines", "none"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "no CUDA device here" in run.stdout  # past the parser, stopped at the GPU check
