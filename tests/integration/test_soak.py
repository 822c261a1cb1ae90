"""`kvdepot bench soak` for half a minute: engines crash and come back, the server stalls;
zero wrong bytes, flat RSS and fds, no leaked locks (the command asserts them itself)."""

from __future__ import annotations

import re
import subprocess
import sys


def test_a_short_soak_passes_and_prints_its_figures():
    result = subprocess.run([sys.executable, "-m", "kvdepot.cli", "bench", "soak",
                             "--minutes", "0.5", "--seed", "3"],
                            capture_output=True, text=True, timeout=600)
    out = result.stdout
    print(out)
    assert result.returncode == 0, out + result.stderr[-4000:]
    assert re.search(r"wrong bytes:\s+0 \(checked [0-9.]+ MiB in [1-9]\d* loaded blocks", out)
    assert re.search(r"faults:\s+[1-9]\d* \([1-9]\d* server stalls", out)
    assert re.search(r"leaked locks:\s+0 ", out)
    assert "result:        ok" in out
