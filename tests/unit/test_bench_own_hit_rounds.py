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


def test_the_median_interval_is_the_binomial_order_statistics() -> None:
    # The ranks of the textbook table for a 95% interval of a median: n=10 gives the 2nd
    # and 9th values, n=20 the 6th and 15th, n=50 the 18th and 33rd, n=100 the 40th and 61st.
    for n, (low, high) in {10: (2, 9), 20: (6, 15), 50: (18, 33), 100: (40, 61)}.items():
        values = [float(rank) for rank in range(n, 0, -1)]  # given unsorted
        assert own_hit_rounds.median_interval(values) == (low, high)
    # Five values cannot give 95%: 2 x (1/2)^5 > 5%.
    assert own_hit_rounds.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) == (-math.inf, math.inf)


def test_paired_differences_cancel_a_drift_that_falls_on_both_engines() -> None:
    # The host slows down round by round; kvdepot is always 0.3 ms behind none in the same
    # round. Unpaired, the spread hides that; paired, it is exact, and shown to be slower.
    drift = [10.0 + 2.0 * i for i in range(20)]
    times = {"none": {2048: [(t, None) for t in drift]},
             "kvdepot": {2048: [(t + 0.3, None) for t in drift]}}
    row = own_hit_rounds.summarize(times, [2048])[2048]["kvdepot"]
    assert row["paired_ms"] == pytest.approx(0.3)
    assert row["paired_low_ms"] == pytest.approx(0.3) == row["paired_high_ms"]
    assert own_hit_rounds.verdict(row) == "slower"
    first = own_hit_rounds.summarize(times, [2048])[2048]["none"]
    assert (first["paired_ms"], first["paired_low_ms"]) == (0.0, 0.0)


def test_the_verdict_needs_the_whole_interval_on_one_side_of_zero() -> None:
    base = [20.0 + (i % 7) for i in range(30)]
    mixed = [b + d for b, d in zip(base, [-0.5, 0.5] * 15, strict=True)]
    faster = [b - 0.2 - 0.01 * i for i, b in enumerate(base)]
    times = {"none": {8192: [(t, None) for t in base]},
             "noop": {8192: [(t, None) for t in mixed]},
             "kvdepot": {8192: [(t, None) for t in faster]}}
    line = own_hit_rounds.summarize(times, [8192])[8192]
    assert line["noop"]["paired_low_ms"] < 0 < line["noop"]["paired_high_ms"]
    assert own_hit_rounds.verdict(line["noop"]) == "no difference shown"
    assert own_hit_rounds.verdict(line["kvdepot"]) == "faster"


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
