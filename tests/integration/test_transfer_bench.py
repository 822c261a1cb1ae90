"""`kvdepot bench transfer` with several engine processes (`--engines`, `--tp`) against one
real server, on CPU engines (shared memory): every process moves bytes both ways, the
aggregate is the sum of the processes, bad argument combinations are refused up front,
and an engine process that dies ends the run instead of hanging it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = [sys.executable, "-m", "kvdepot.cli", "bench", "transfer", "--device", "cpu"]
SMALL = ["--l1-size", str(1 << 30), "--chunks-per-op", "1", "--retrieve-set", "2",
         "--inflight", "2"]


def test_two_engines_of_two_ranks_each_move_bytes_both_ways(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    done = subprocess.run([*BENCH, "--engines", "2", "--tp", "2", "--seconds", "0.5", *SMALL,
                           "--json", str(report_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["limits"]["host_memory"]["h2d"] > 0
    (result,) = report["results"]
    assert [(p["engine"], p["rank"]) for p in result["processes"]] == [(0, 0), (0, 1), (1, 0),
                                                                       (1, 1)]
    assert len({p["pid"] for p in result["processes"]}) == 4
    phases = {phase["name"]: phase for phase in result["phases"]}
    assert list(phases) == ["store", "retrieve", "store+retrieve"]
    for name, phase in phases.items():
        each, every = phase["per_process"], phase["aggregate"]
        assert len(each) == 4 and every["processes"] == 4
        for process in each:
            assert process["errors"] == 0
            if "store" in name:
                assert process["stores"] > 0 and process["stored_bytes"] > 0
            if "retrieve" in name:
                assert process["retrieves"] > 0 and process["retrieved_bytes"] > 0
            # Stores alone retrieve nothing, and the other way round.
            assert ("store" in name) == (process["stored_bytes"] > 0)
            assert ("retrieve" in name) == (process["retrieved_bytes"] > 0)
        for key in ("stored_bytes", "retrieved_bytes", "stores", "retrieves", "errors"):
            assert every[key] == sum(p[key] for p in each), (name, key)
        assert every["operations_per_s"] == pytest.approx(
            (every["stores"] + every["retrieves"]) / every["seconds"])
        assert every["operations_per_s"] > 0
        # The common window spans every process's own.
        assert every["seconds"] >= max(p["seconds"] for p in each)
        assert phase["server_cores"] > 0
    assert "operations/s" in done.stdout and "engine 1 rank 1" in done.stdout


@pytest.mark.parametrize(("arguments", "message"), [
    (["--engines", "0"], "--engines: must be at least 1"),
    (["--tp", "-1"], "--tp: must be at least 1"),
    (["--gpus", "0,1"], "--gpus places engine processes on GPUs: it needs --device cuda"),
    (["--gpus", "0,x"], "expected GPU indices"),
    (["--engines", "2", "--compute-probe"], "--compute-probe runs beside one engine"),
    (["--tp", "3", "--l1-size", str(256 << 20)], "raise --l1-size"),
    (["--geometry", "no-such-geometry"], "no geometry matches"),
])
def test_a_bad_argument_combination_is_refused_with_exit_code_2(arguments: list[str],
                                                                 message: str) -> None:
    done = subprocess.run([*BENCH, *arguments], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def _engine_processes(parent: int) -> list[int]:
    """The bench's engine processes (its children running `transfer_engine`)."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    found = []
    for pid in children:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"kvdepot.bench.transfer.engine" in command:
            found.append(int(pid))
    return found


def test_an_engine_process_that_dies_ends_the_run_with_exit_code_1() -> None:
    bench = subprocess.Popen([*BENCH, "--engines", "2", "--seconds", "3", *SMALL],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert bench.stdout is not None
        for line in bench.stdout:
            if "warm-up: stored" in line:  # every engine registered; the store phase starts
                break
        else:
            pytest.fail(f"the benchmark ended before its phases: {bench.stderr.read()}")
        engines = _engine_processes(bench.pid)
        assert len(engines) == 2
        os.kill(engines[1], signal.SIGKILL)
        # Well below the parent's reply timeout: it must see the exit, not wait that out.
        out, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 1, out[-2000:] + err[-2000:]
    assert re.search(r"engine [01] rank 0 exited \(killed by signal 9\); the run stops", err), err
    assert "Traceback" not in err
