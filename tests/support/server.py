"""Start a real `kvdepot serve` process for a test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from kvdepot.rpc.connection import wait_for_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, port: int | None = None, l1_size: str = "256MiB", chunk_size: int = 64,
                 lock_ttl: float = 300.0, extra: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "kvdepot.cli", "serve", "--port", str(self.port),
                     "--l1-size", l1_size, "--chunk-size", str(chunk_size),
                     "--lock-ttl", str(lock_ttl), *extra]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> ServerProcess:
        self.proc = subprocess.Popen(self.args, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for_server(self.url, timeout, self.proc)
        return self

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> str:
        """SIGTERM and wait; returns everything the server printed."""
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out or ""


@contextmanager
def running_server(**kwargs) -> Iterator[ServerProcess]:
    server = ServerProcess(**kwargs).start()
    try:
        yield server
    finally:
        server.stop()
