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
