"""`kvdepot bench ...`: each benchmark prints its figures beside the physical limit it
measured in the same run."""

from __future__ import annotations

import argparse

BENCHMARKS = ("control", "transfer", "e2e", "soak", "workload", "route", "admin", "remote",
              "flood")

COMMAND_MODULES = {name: f"kvdepot.bench.{name}" for name in BENCHMARKS}
"""The module that declares and runs each command: one per command, the transfer bench's
in a sub-package of its own (its engine processes, limits and report beside it)."""
COMMAND_MODULES["transfer"] = "kvdepot.bench.transfer.command"


def register_commands(sub: argparse._SubParsersAction) -> None:
    """Every benchmark is listed even where a package it imports is missing (a GPU host
    without pyzmq, say): running it then names what to install, instead of the command
    vanishing from `--help`."""
    import importlib

    for name in BENCHMARKS:
        try:
            module = importlib.import_module(COMMAND_MODULES[name])
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] == "kvdepot":
                raise
            _add_unavailable(sub, name, exc.name)
            continue
        module.add_command(sub)


def _add_unavailable(sub: argparse._SubParsersAction, name: str, missing: str) -> None:
    def run(_: argparse.Namespace) -> int:
        print(f"kvdepot bench {name}: needs the Python package {missing!r}, which is not "
              f"installed (pip install {missing})")
        return 2

    parser = sub.add_parser(name, help=f"(unavailable: needs {missing})")
    parser.set_defaults(run=run)
