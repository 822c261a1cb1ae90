"""`kvdepot serve` as a subprocess for the GPU tests, and the environment children need."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from kvdepot.client.admin import AdminClient
from kvdepot.errors import ServerUnavailable
from kvdepot.rpc.connection import wait_for_server

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
    def __init__(self, mode: str, log_path: Path, env_overrides: dict[str, str] | None = None
                 ) -> None:
        self.port = free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = child_env()
        env["KVDEPOT_CUDA_COPY"] = mode
        env.update(env_overrides or {})
        self.log = open(log_path, "wb")  # noqa: SIM115 (kept open for the process's life)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvdepot.cli", "serve", "--port", str(self.port),
             "--l1-size", "4GiB", "--log-level", "INFO"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_for_server(self.url, 60, self.proc)
        except ServerUnavailable as exc:
            raise RuntimeError(f"kvdepot serve did not start ({exc}); see {log_path}") from None

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
