"""An engine process that stores and retrieves, then exits the way a vLLM engine does.

`python -m tests.gpu.support.engine_exit URL shutdown|no-shutdown`: with `shutdown` the
worker unregisters first (as vLLM's connector shutdown does). Either way the KV cache
stays referenced until the process exits, as a vLLM engine's does, so torch's exit-time
check of CUDA memory it shared with other processes sees it.
"""

from __future__ import annotations

import ctypes
import sys

from tests.gpu.support.engine import Engine


def main() -> int:
    url, how = sys.argv[1], sys.argv[2]
    engine = Engine(url, "flash_attn", num_blocks=64)
    if not engine.round_trip(7):
        print("mismatch", flush=True)
        return 1
    if how == "shutdown":
        engine.adapter.shutdown()
    # Never freed, not even while the interpreter finalizes: an engine's KV cache lives
    # until its process ends.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(engine.caches))
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
