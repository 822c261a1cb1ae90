"""Make the server's large memory copies use non-temporal (streaming) stores.

A CPU engine's KV blocks travel as segments of a few hundred KiB (vLLM's CPU layout:
one block of one layer) that nobody reads again soon. glibc's memcpy uses streaming
stores only above its non-temporal threshold (several MiB on most machines); below it
every destination cache line is first read in (read-for-ownership), so the memory bus
carries three bytes per byte copied instead of two. On a machine whose copies are bound
by the memory bus that is a third of the bandwidth (docs/benchmarks.md).

glibc reads its tunables once, at process start, so the server re-executes itself once
with the threshold lowered. An operator who sets the tunable in GLIBC_TUNABLES keeps
their value.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
THRESHOLD = 0x30000
"""192 KiB: KV segments (256 KiB and up) stream, while a lookup's token payload (128 KiB
for a 32k-token prompt), which is hashed right after it is copied, stays in the cache."""


def wanted() -> bool:
    return (sys.platform.startswith("linux") and platform.machine() == "x86_64"
            and platform.libc_ver()[0] == "glibc"
            and TUNABLE not in os.environ.get("GLIBC_TUNABLES", ""))


def reexec_with_streaming_stores(args: list[str]) -> None:
    """Replace this process with `python -m kvdepot.cli *args` under the lowered threshold
    (same PID, so whoever started the server still holds it); returns only where the
    tunable does not apply or is already set."""
    if not wanted():
        return
    current = os.environ.get("GLIBC_TUNABLES", "")
    setting = f"{TUNABLE}={THRESHOLD:#x}"
    env = dict(os.environ, GLIBC_TUNABLES=f"{current}:{setting}" if current else setting)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "kvdepot.cli", *args], env)
