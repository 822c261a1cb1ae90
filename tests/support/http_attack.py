"""The tests' side of tests/support/http_flood.py: a server with both HTTP listeners, and
another user's floods and hostile requests against them, started through setpriv."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from dataclasses import dataclass
from typing import Any

from kvdepot.testbed.server_process import ServerProcess
from tests.support.as_user import NOBODY, AttackerProcess, python_as_user
from tests.support.server import free_port, small_server


@dataclass
class HttpServer:
    server: ServerProcess
    admin_port: int
    metrics_port: int

    def get(self, port: int, path: str) -> tuple[int, bytes]:
        """(status, body) of a GET by this (the server's) user, on a connection of its own."""
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def readyz(self) -> tuple[int, dict[str, Any]]:
        status, body = self.get(self.admin_port, "/readyz")
        return status, json.loads(body)


def http_server(descriptor_limit: int | None = None, *extra: str) -> HttpServer:
    """A server (not started) with the admin API and the metrics listener, under the given
    RLIMIT_NOFILE (soft and hard: the server cannot raise it), set by prlimit(1)."""
    admin, metrics = free_port(), free_port()
    server = small_server(extra=("--admin-port", str(admin), "--metrics-port", str(metrics),
                                 *extra))
    if descriptor_limit is not None:
        server.args = ["prlimit", f"--nofile={descriptor_limit}:{descriptor_limit}",
                       *server.args]
    return HttpServer(server, admin, metrics)


class HeldConnections(AttackerProcess):
    """`python -m tests.support.http_flood hold` as another user: connections that send
    half a request line and then nothing. Its report also says "within_a_second" (see
    tests/support/http_flood.py)."""

    def __init__(self, ports: list[int], connections: int, uid: int = NOBODY,
                 again: bool = False, silent: bool = False) -> None:
        """`again`: each connection the server ends is replaced by a new one; `silent`:
        not a byte is sent. Call `connected` before anything else."""
        super().__init__(python_as_user(
            "tests.support.http_flood", "hold", ",".join(map(str, ports)), str(connections),
            *(["again"] if again else []), *(["silent"] if silent else []), uid=uid))
        self.held = 0

    def connected(self) -> HeldConnections:
        """Waits until every first connection is made (`held` says how many were)."""
        self.held = int(self._line()["held"])
        return self


def hostile_request(port: int, kind: str, uid: int = NOBODY) -> dict[str, Any]:
    """`python -m tests.support.http_flood request PORT KIND` as another user."""
    done = subprocess.run(python_as_user("tests.support.http_flood", "request", str(port), kind,
                                         uid=uid),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
