"""`kvdepot serve` as a subprocess for the GPU tests, and the environment children need."""

from __future__ import annotations

import os
from pathlib import Path

from kvdepot.testbed.server_process import ServerProcess

HERE = Path(__file__).parent
SRC = HERE.parent.parent / "src"


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return env


def start_server(mode: str, log_path: Path, env_overrides: dict[str, str] | None = None
                 ) -> ServerProcess:
    """A started server with copy mode `mode` (KVDEPOT_CUDA_COPY) in its GPUs' copy
    processes, logging to `log_path`."""
    env = {**child_env(), "KVDEPOT_CUDA_COPY": mode, **(env_overrides or {})}
    return ServerProcess(l1_size="4GiB", env=env,
                         extra=("--log-level", "INFO"),
                         output=log_path).start(timeout=60)
