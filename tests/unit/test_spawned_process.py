"""`in_spawned_process`, which runs each benchmark engine in a fresh process: its result
comes back, and with a timeout a process that never answers is stopped with its children."""

from __future__ import annotations

import os
import time
from typing import Any

import psutil
import pytest

from kvdepot.testbed.measurement import in_spawned_process


def answers(value: int, out: Any) -> None:
    out.put(value * 2)


def hangs_with_a_child(out: Any) -> None:
    import multiprocessing as mp

    child = mp.get_context("spawn").Process(target=time.sleep, args=(600,))
    child.start()
    out_file = os.environ["SPAWN_TEST_PIDS"]
    with open(out_file, "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)


def test_the_result_comes_back() -> None:
    assert in_spawned_process(answers, 21) == 42
    assert in_spawned_process(answers, 4, timeout=60) == 8


def test_past_its_timeout_the_process_and_its_children_are_stopped(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pids_file = tmp_path / "pids"
    monkeypatch.setenv("SPAWN_TEST_PIDS", str(pids_file))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="within 3 s"):
        in_spawned_process(hangs_with_a_child, timeout=3)
    assert time.monotonic() - started < 60
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid
