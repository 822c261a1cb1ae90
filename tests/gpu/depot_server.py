"""`kvdepot serve` as a subprocess for the GPU tests, and the environment children need."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvdepot.client.admin import AdminClient

HERE = Path(__file__).parent
SRC = HERE.parent.parent / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return env


class Server:
    def __init__(self, mode: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        env = child_env()
        env["KVDEPOT_CUDA_COPY"] = mode
        self.log = open(log_path, "wb")  # noqa: SIM115 (kept open for the process's life)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvdepot.cli", "serve", "--port", str(self.port),
             "--l1-size", "4GiB", "--log-level", "INFO"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                with AdminClient(self.url, timeout=1.0) as admin:
                    admin.ping()
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvdepot serve did not start; see {log_path}") from None
                time.sleep(0.2)

    def stats(self) -> dict[str, float]:
        with AdminClient(self.url) as admin:
            return admin.stats()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
