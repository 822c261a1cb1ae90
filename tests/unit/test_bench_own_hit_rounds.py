"""`kvdepot bench e2e --device cuda --own-hit-rounds N`, the parts that need no GPU: the
order the own hits run in, the figures kept from them, and the engines it refuses. The
mode itself, engines and all: `tests/gpu/test_own_hit_rounds_gpu.py`."""

from __future__ import annotations

import math
import multiprocessing
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

from kvdepot.bench import own_hit_rounds


def test_each_round_runs_every_engines_own_hit_of_every_prompt_once() -> None:
    engines, lengths = ["none", "noop", "kvdepot"], [8192, 2048]
    order = own_hit_rounds.round_orders(engines, lengths, rounds=20)
    assert len(order) == 20 * 2 * 3
    assert Counter(order) == {(n, e): 20 for n in lengths for e in engines}
    turns = [tuple(e for _, e in order[i:i + 3]) for i in range(0, len(order), 3)]
    assert all(sorted(turn) == sorted(engines) for turn in turns)
    # No engine always goes first: whatever drifts within a turn falls on each in turn.
    assert {turn[0] for turn in turns} == set(engines)
    assert own_hit_rounds.round_orders(engines, lengths, rounds=20) == order  # seeded


def test_the_figures_kept_are_quartiles_fastest_and_the_gap_to_the_first_engine() -> None:
    times = {"none": {2048: [(20.0, 17.0), (22.0, 18.0), (30.0, 27.0), (21.0, None)]},
             "kvdepot": {2048: [(23.0, 19.0), (24.0, 20.0), (25.0, 21.0), (40.0, 36.0)]}}
    line = own_hit_rounds.summarize(times, [2048])[2048]
    assert line["none"]["median_ms"] == 21.5 and line["none"]["fastest_ms"] == 20.0
    assert line["none"]["step_ms"] == 18.0  # the run that reported no step is left out
    assert line["none"]["vs_first_ms"] == 0.0
    assert line["kvdepot"]["vs_first_ms"] == pytest.approx(3.0)
    assert line["kvdepot"]["q1_ms"] <= line["kvdepot"]["median_ms"] <= line["kvdepot"]["q3_ms"]
    assert line["kvdepot"]["runs"] == 4


def test_the_quartiles_of_a_few_rounds_stay_within_the_times_measured() -> None:
    line = own_hit_rounds.summarize({"noop": {512: [(28.7, 27.0), (38.9, 30.0)]}}, [512])[512]
    row = line["noop"]
    assert row["fastest_ms"] <= row["q1_ms"] <= row["median_ms"] <= row["q3_ms"] <= 38.9


def test_one_round_gives_its_one_time_for_every_figure() -> None:
    line = own_hit_rounds.summarize({"none": {512: [(9.0, None)]}}, [512])[512]["none"]
    assert (line["median_ms"], line["q1_ms"], line["q3_ms"]) == (9.0, 9.0, 9.0)
    assert math.isnan(line["step_ms"])


def test_lmcache_and_unknown_engines_are_refused_before_anything_starts() -> None:
    own_hit_rounds.check_engines(["none", "noop", "kvdepot", "kvdepot-async", "offload"])
    with pytest.raises(ValueError, match="not lmcache"):
        own_hit_rounds.check_engines(["none", "lmcache"])


def _bench(*words: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvdepot.cli", "bench", "e2e", "--device",
                           "cuda", *words], capture_output=True, text=True, timeout=120)


def test_the_command_refuses_lmcache_before_it_starts_anything() -> None:
    run = _bench("--own-hit-rounds", "2", "--engines", "none,lmcache")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "not lmcache" in run.stdout
    assert "vLLM's own log" not in run.stdout  # no model written, no server started


def test_without_a_gpu_the_command_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = _bench("--own-hit-rounds", "2", "--engines", "none,noop")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "no CUDA device here" in run.stdout


def test_an_engine_that_dies_or_stalls_is_named_and_never_waited_for_past_its_bound() -> None:
    ctx = multiprocessing.get_context("spawn")
    # An engine process gone before answering: its pipe's far end closes with it.
    ours, theirs = ctx.Pipe()
    dead = ctx.Process(target=sys.exit, args=(3,))
    dead.start()
    dead.join(60)
    theirs.close()
    with pytest.raises(RuntimeError, match=r"starting kvdepot: the engine process exited "
                                           r"\(status 3\)"):
        own_hit_rounds._receive(ours, dead, 30.0, "starting kvdepot")
    # One alive that never answers: given up once its bound has passed.
    ours, theirs = ctx.Pipe()
    stalled = ctx.Process(target=time.sleep, args=(60,))
    stalled.start()
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"noop's own hit: no answer within 0\.5 s"):
            own_hit_rounds._receive(ours, stalled, 0.5, "noop's own hit")
        assert time.monotonic() - started < 10
    finally:
        stalled.kill()
        stalled.join(10)
        theirs.close()
