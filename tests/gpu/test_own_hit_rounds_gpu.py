"""`kvdepot bench e2e --device cuda --own-hit-rounds N` end to end on the GPU: three real
vLLM 0.26 engines (no connector, a connector doing nothing, kvdepot) alive at once on the
one GPU, their own hits taken in turn. Skips where no CUDA device or no vLLM is installed
(CI has neither). A 2-layer model of Llama-3.1-8B's shape keeps it short."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

pytestmark = [
    pytest.mark.gpu, pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_engines_own_hits_run_in_turn_and_kvdepot_sends_the_server_nothing(
        tmp_path: Path) -> None:
    report = tmp_path / "rounds.json"
    run = subprocess.run(
        [sys.executable, "-m", "kvdepot.cli", "bench", "e2e", "--device", "cuda", "--layers", "2",
         "--prompt-lengths", "1024,2048", "--engines", "none,noop,kvdepot",
         "--own-hit-rounds", "3", "--eager", "--json", str(report)],
        capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(report.read_text())
    for length in ("1024", "2048"):
        line = result["own_hit_rounds"][length]
        assert {engine: row["runs"] for engine, row in line.items()} == {
            "none": 3, "noop": 3, "kvdepot": 3}
        assert line["none"]["vs_first_ms"] == 0.0
        assert all(row["fastest_ms"] > 0 for row in line.values())
    # vLLM holds every prompt: an own hit is no reason to look up or store anything.
    assert result["server_during_rounds"]["lookups"] == 0
    assert result["server_during_rounds"]["stores"] == 0
    assert "kvdepot server during the rounds: lookups +0" in run.stdout
