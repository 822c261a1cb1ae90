"""`kvdepot bench remote` on small clusters it starts itself: its rates beside the C
client's, every promoted byte checked (the command asserts that itself)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kvdepot.bench.redis_processes import redis_benchmark_binary
from tests.support.redis_servers import redis_server_binary


def test_a_small_run_over_one_and_three_masters_prints_every_rate():
    if redis_server_binary() is None or redis_benchmark_binary() is None:
        pytest.skip("redis-server or redis-benchmark is not installed (scripts/bootstrap "
                    "installs both as root)")
    # Few, small chunks: a memory limit near the data once evicted pieces before the read.
    result = subprocess.run([sys.executable, "-m", "kvdepot.cli", "bench", "remote",
                             "--chunks", "4", "--chunk-size", "1MiB", "--piece-sizes",
                             "256KiB", "--repeats", "1", "--masters", "1,3"],
                            capture_output=True, text=True, timeout=600)
    out = result.stdout
    print(out)
    assert result.returncode == 0, out + result.stderr[-4000:]
    rows = re.findall(r"^\s+256\.0 KiB((?:\s+[0-9.]+%?){8})\s*$", out, re.MULTILINE)
    assert len(rows) == 2, out  # one per cluster, every figure a number (no nan)
    assert "1 masters" in out and "3 masters" in out
    assert out.count("an 8192-token prefix at the promotion rate") == 2
