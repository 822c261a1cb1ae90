"""`kvdepot serve` as a subprocess for the GPU tests, and how the tests start children.

The helper scripts beside this file (engine.py, engine_exit.py, vmm_sender.py) run as
modules, `python -m tests.gpu.support.NAME`: `script` gives that command line, and
`child_env` the environment that finds both kvdepot and the tests' package in any working
directory. Nothing else touches an import path.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvdepot.testbed.server_process import ServerProcess

REPO = Path(__file__).parents[3]
SRC = REPO / "src"


def child_env() -> dict[str, str]:
    """This process's environment, with src (kvdepot) and the repository (`tests`) first
    on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), str(REPO),
                                                      env.get("PYTHONPATH")]))
    return env


def script(name: str, *args: str, python: str = sys.executable) -> list[str]:
    """The command line that runs helper script `name` (tests/gpu/support/NAME.py) with
    `args`; run it with `child_env()`'s environment."""
    return [python, "-m", f"{__package__}.{name}", *args]


def start_server(mode: str, log_path: Path, env_overrides: dict[str, str] | None = None
                 ) -> ServerProcess:
    """A started server with copy mode `mode` (KVDEPOT_CUDA_COPY) in its GPUs' copy
    processes, logging to `log_path`."""
    env = {**child_env(), "KVDEPOT_CUDA_COPY": mode, **(env_overrides or {})}
    return ServerProcess(l1_size="4GiB", env=env,
                         extra=("--log-level", "INFO"),
                         output=log_path).start(timeout=60)
