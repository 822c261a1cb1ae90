"""`kvdepot bench control --gap-ms`: each timed lookup (and each round trip of the limit)
comes after the idle time asked for, as an engine's lookups do, and the idle time itself
is never counted in a lookup's latency."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from kvdepot.bench.control import bare_round_trip


def _latencies(stdout: str, row: str) -> list[float]:
    line = next(line for line in stdout.splitlines() if line.startswith(row))
    return [float(x) for x in re.findall(r"\d+\.\d+", line[len(row):])]


def test_lookups_after_an_idle_gap_are_timed_without_it() -> None:
    gap_ms, iterations = 50, 12
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "kvdepot.cli", "bench", "control", "--tokens", "1024",
         "--iterations", str(iterations), "--clients", "1", "--seconds", "0.5",
         "--gap-ms", str(gap_ms)],
        capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - started
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"{gap_ms} ms idle before each timed lookup and round trip" in run.stdout
    # The gap was waited out before every timed lookup and every timed round trip...
    assert elapsed >= 2 * iterations * gap_ms / 1e3
    # ...and is in none of them: the median lookup and round trip are far below it.
    p50, *_ = _latencies(run.stdout, "lookup + status (kvdepot)")
    bare_p50, *_ = _latencies(run.stdout, "bare ZeroMQ round trip (limit)")
    assert 0 < p50 < gap_ms / 2 and 0 < bare_p50 < gap_ms / 2


def test_back_to_back_is_the_default() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvdepot.cli", "bench", "control", "--tokens", "512",
         "--iterations", "5", "--clients", "1", "--seconds", "0.3"],
        capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "; back to back" in run.stdout


def test_the_limit_waits_the_gap_before_each_timed_round_trip_only() -> None:
    started = time.monotonic()
    samples = bare_round_trip(b"\0" * 4096, iterations=6, gap_s=0.05)
    elapsed = time.monotonic() - started
    assert len(samples) == 6
    assert elapsed >= 6 * 0.05
    assert max(samples) < 0.05  # none of them holds its gap
