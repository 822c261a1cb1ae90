"""A server's CPU time, as the benchmarks report it, includes its GPU copy processes'."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvdepot.testbed.server_process import child_pids, cpu_seconds

BUSY = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"


def test_running_and_exited_children_count_with_children_and_not_without() -> None:
    me = os.getpid()
    alone, everything = cpu_seconds(me), cpu_seconds(me, children=True)
    running = subprocess.Popen([sys.executable, "-c", BUSY + "time.sleep(30)"])
    exited = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        exited.wait(timeout=60)
        deadline = time.monotonic() + 60
        while cpu_seconds(running.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running.pid in child_pids(me)
        grown = cpu_seconds(me, children=True) - everything
        mine = cpu_seconds(me) - alone
        assert grown - mine >= 0.9, (grown, mine)  # 0.5 s each, the exited one reaped
    finally:
        running.kill()
        running.wait()
