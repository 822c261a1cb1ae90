"""Runs `release_checks.py` under several vLLM releases, each in a process of its own forked
from this one, which has imported what every release shares first.

    python -m tests.vllm_releases.zygote JOBS_JSON

Importing a release of vLLM costs its own modules plus torch and transformers, which
weigh three times as much and are the same for every release (the .venv's). This process
imports those once; each child then puts its release's folder first on its path (and in
PYTHONPATH, for the processes vLLM itself starts), imports vLLM from there, and runs the
checks with pytest. JOBS_JSON is a list of {"version", "path" (the folders to put first),
"env", "args" (pytest's), "log"}; at most `at_once` children run together. Prints one line
per finished child: the version and the exit status.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

# What every release imports from the .venv; nothing of vLLM may be imported here.
import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import configuration_utils, modeling_utils  # noqa: F401

assert "vllm" not in sys.modules, "the zygote must not import any release of vLLM"


def _child(job: dict[str, Any]) -> int:
    os.environ.update(job["env"])
    os.environ["PYTHONPATH"] = os.pathsep.join(job["path"])
    sys.path[:0] = job["path"]
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import pytest

    return int(pytest.main(job["args"]))


def main() -> None:
    jobs: list[dict[str, Any]] = json.loads(sys.argv[1])
    at_once = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    running: dict[int, str] = {}
    pending = list(jobs)
    while pending or running:
        while pending and len(running) < at_once:
            job = pending.pop(0)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                status = 1
                try:
                    status = _child(job)
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(status)
            running[pid] = job["version"]
        pid, status = os.wait()
        version = running.pop(pid)
        print(version, os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main()
