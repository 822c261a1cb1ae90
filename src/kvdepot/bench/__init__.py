"""`kvdepot bench ...`: each benchmark prints its figures beside the physical limit it
measured in the same run."""

from __future__ import annotations

import argparse


def register_commands(sub: argparse._SubParsersAction) -> None:
    import importlib

    for name in ("control", "transfer", "e2e", "soak", "workload", "admin", "remote"):
        try:
            module = importlib.import_module(f"kvdepot.bench.{name}")
        except ModuleNotFoundError:
            continue
        module.add_command(sub)
