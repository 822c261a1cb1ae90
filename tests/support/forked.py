"""Test processes forked from a server that imported torch once (multiprocessing's
forkserver), each started as a spawned one would be.

A spawned process imports torch again (about two seconds of CPU on the development
VM, and most integration tests start one or more engine processes). The fork server
imports only torch, numpy and pyzmq, which read nothing of what tests change, and it
starts no threads. A child forked from it then takes the environment and working
directory of the test that starts it, as a spawned child would, before it imports
anything of kvdepot or the tests.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from multiprocessing.context import BaseContext
from typing import Any

PRELOAD = ["torch", "numpy", "zmq"]

_context = mp.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def context() -> BaseContext:
    return _context


def target_args(module: str, function: str, *args: Any) -> tuple[Any, ...]:
    """`Process(target=run_here, args=target_args(...))`: calls `module.function(*args)`
    in the child, with this process's environment and working directory."""
    return (dict(os.environ), os.getcwd(), module, function, *args)


def run_here(environ: dict[str, str], cwd: str, module: str, function: str,
             *args: Any) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    getattr(importlib.import_module(module), function)(*args)


class ForkedChild:
    """What the tests use of `subprocess.Popen`, for a process of the fork server: its
    pid, exit status (negative: the signal that ended it), signals and waits."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid
        self.args: list[str] = []

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_command(argv: list[str], environ: dict[str, str], output: str | None
                  ) -> ForkedChild:
    """`python -m kvdepot.cli *argv`, as a child of the fork server: the same code from
    `kvdepot.cli.main` on, without importing torch again. It prints to the file `output`
    (appending), or where this process prints if None."""
    # Daemonic: a server a failed test left running ends with this process.
    process = _context.Process(target=_run_command, args=(argv, environ, os.getcwd(), output),
                               daemon=True)
    process.start()
    child = ForkedChild(process)
    child.args = argv
    return child


def _run_command(argv: list[str], environ: dict[str, str], cwd: str,
                 output: str | None) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    if output is not None:
        fd = os.open(output, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    # As PYTHONUNBUFFERED would: a killed server's last lines are in the file.
    sys.stdout.reconfigure(line_buffering=True, write_through=True)
    sys.stderr.reconfigure(line_buffering=True, write_through=True)
    from kvdepot.cli import main

    sys.exit(main(argv))
