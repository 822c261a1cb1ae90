"""`kvdepot bench remote` on small clusters it starts itself: its rates beside the C
client's, every promoted byte checked (the command asserts that itself)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kvdepot.testbed.redis_processes import RedisProcess, redis_benchmark_binary
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
    # Which server answered, with its version (Redis and Valkey serve big values apart).
    assert len(re.findall(r"\((?:Redis|Valkey) \d+\.\d+", out)) == 2, out
    assert out.count("an 8192-token prefix at the promotion rate") == 2


FAKE_C_CLIENT = '''#!{python}
"""A C client whose GETs all miss (as valkey-benchmark 8.0's cluster mode does): each
asks for a key nobody wrote, then it reports a high rate."""
import sys
import redis
args = sys.argv[1:]
port, requests, tests = (int(args[args.index("-p") + 1]), int(args[args.index("-n") + 1]),
                         args[args.index("-t") + 1])
print('"test","rps"')
print('"SET","100.0"')
if "get" in tests:
    client = redis.Redis(port=port)
    for i in range(requests):
        assert client.get(f"never-written-{{i}}") is None
    print('"GET","100000.0"')
'''


def test_a_c_client_whose_gets_miss_gives_no_get_figure(tmp_path, monkeypatch):
    """A GET of a missing key moves nothing: the bench must not compare kvdepot with the
    rate of such GETs."""
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    fake = tmp_path / "fake-benchmark"
    fake.write_text(FAKE_C_CLIENT.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("KVDEPOT_REDIS_BENCHMARK", str(fake))
    result = subprocess.run([sys.executable, "-m", "kvdepot.cli", "bench", "remote",
                             "--chunks", "2", "--chunk-size", "1MiB", "--piece-sizes",
                             "256KiB", "--repeats", "1", "--masters", "1"],
                            capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-4000:]
    assert "the C client's GETs found 0% of their keys: no GET figure" in out, out
    row = re.search(r"^\s+256\.0 KiB\s+(\S+)\s+\S+\s+\S+\s+\S+\s+(\S+)", out, re.MULTILINE)
    assert row is not None, out
    assert row.group(2) == "nan", out  # the C GET column: no figure, not 100000 x 256 KiB


def test_the_servers_keep_freed_pages_as_operators_are_advised(tmp_path):
    """jemalloc itself reports the option in effect: the bench's and the tests' servers
    run as docs/shared-tier.md advises, so a master's first big reply after a pause does
    not fault its buffer in again."""
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (scripts/bootstrap installs it as root)")
    server = RedisProcess(tmp_path).start()
    try:
        client = server.client()
        stats = client.execute_command("MEMORY", "MALLOC-STATS")
        client.close()
    finally:
        server.stop()
    text = stats.decode() if isinstance(stats, bytes) else stats
    if "opt.dirty_decay_ms" not in text:
        pytest.skip("this server's allocator is not jemalloc")
    assert "opt.dirty_decay_ms: -1" in text, text[:2000]
