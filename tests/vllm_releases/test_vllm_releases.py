"""The connector in every vLLM release from 0.26 to 0.34, inside each release's own
scheduler (`release_checks.py`), against one real kvdepot server with a disk tier.

Each release runs in a child pytest of its own (forked by `zygote.py`), with its Python
files first on its path (`releases.py` fetches them once) and the .venv's packages behind
them. A release that does not import here is reported as skipped, with the child's reason;
one that cannot be fetched, with pip's.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvdepot.testbed.checkpoint import SIZES, seeded_checkpoint
from tests.support.server import small_server
from tests.vllm_releases.releases import (
    CACHE,
    RELEASES,
    REPO,
    installed_release,
    python_files,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHECKS = Path(__file__).with_name("release_checks.py")
AT_ONCE = 2
"""Children running at once, on two cores next to the rest of the suite."""
ALL_TIMEOUT = 800


@dataclass
class Outcome:
    passed: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    output: str = ""


def _skip_reason(skip: ET.Element) -> str:
    """A skip's reason: JUnit reports a skip at import (the module's) as "collection
    skipped", with pytest's (file, line, reason) tuple as its text."""
    message = skip.get("message", "")
    if message == "collection skipped" and skip.text:
        try:
            return str(ast.literal_eval(skip.text)[2]).removeprefix("Skipped: ")
        except (ValueError, SyntaxError, IndexError, TypeError):
            return skip.text
    return message


def _read(report: Path, log: Path, status: int | None) -> Outcome:
    """A child's outcome, from its JUnit report."""
    output = log.read_text(errors="replace")[-8000:] if log.exists() else ""
    if not report.exists():
        return Outcome(failed=[f"the child wrote no report (exit {status})"], output=output)
    outcome = Outcome(output=output)
    for case in ET.parse(report).getroot().iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skip = case.find("skipped")
        if problem is not None:
            outcome.failed.append(f"{case.get('name')}: {problem.get('message', '')[:300]}")
        elif skip is not None:
            outcome.skipped.append(_skip_reason(skip))
        else:
            outcome.passed += 1
    if status not in (0, 5) and not outcome.failed:
        outcome.failed.append(f"the child exited with {status}")
    return outcome


def _own_cache(version: str) -> dict[str, str]:
    """vLLM's cache folder for a fetched release. vLLM inspects a model's class in a
    child process (seconds of CPU) and caches the result in one file per class, keyed by
    the hash of the model's module: releases sharing the folder would overwrite each other's
    entry and inspect again on every run. The .venv's release keeps vLLM's default."""
    if version == installed_release():
        return {}
    return {"VLLM_CACHE_ROOT": str(CACHE / f"{version}.vllm-cache")}


def _folders(version: str) -> list[str] | str:
    """What goes first on the child's path, or why the release could not be had."""
    if version == installed_release():
        return [str(REPO)]
    try:
        return [str(python_files(version)), str(REPO)]
    except Exception as exc:
        return f"could not be fetched: {exc}"


@pytest.fixture(scope="module")
def outcomes() -> Iterator[dict[str, Outcome]]:
    model = seeded_checkpoint(SIZES["small"])
    with ThreadPoolExecutor(4) as pool:  # downloads (the first run only): the network's
        folders = dict(zip(RELEASES, pool.map(_folders, RELEASES), strict=True))
    results = {v: Outcome(skipped=[reason]) for v, reason in folders.items()
               if isinstance(reason, str)}
    with tempfile.TemporaryDirectory() as scratch, \
            small_server(l1_size="512MiB", extra=(
                "--disk-path", str(Path(scratch) / "disk"), "--disk-size", "256MiB")) as server:
        env = {"KVDEPOT_RELEASE_URL": server.url, "KVDEPOT_RELEASE_MODEL": str(model),
               "VLLM_LOGGING_LEVEL": "WARNING"}
        jobs = [{"version": v, "path": path, "env": {**env, **_own_cache(v)},
                 "log": f"{scratch}/{v}.log",
                 # Each check's limit, as the suite's, but for a machine that also runs
                 # the rest of the suite: a first run inspects the model in a child process.
                 "args": ["-q", "--noconftest", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-o", "timeout=600",
                          f"--junitxml={scratch}/{v}.xml", str(CHECKS)]}
                for v, path in folders.items() if not isinstance(path, str)]
        run = subprocess.run(
            [sys.executable, "-m", "tests.vllm_releases.zygote", json.dumps(jobs),
             str(AT_ONCE)], cwd=REPO, capture_output=True, text=True, timeout=ALL_TIMEOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        statuses = dict(line.split() for line in run.stdout.splitlines() if line.strip())
        for job in jobs:
            version = job["version"]
            status = statuses.get(version)
            outcome = _read(Path(f"{scratch}/{version}.xml"), Path(job["log"]),
                            int(status) if status is not None else None)
            if status is None:
                outcome.output += f"\nzygote (exit {run.returncode}): {run.stderr[-3000:]}"
            results[version] = outcome
        yield results


@pytest.mark.parametrize("version", RELEASES)
def test_the_connector_in_vllms_scheduler(outcomes: dict[str, Outcome], version: str) -> None:
    outcome = outcomes[version]
    assert not outcome.failed, f"vLLM {version}: {outcome.failed}\n{outcome.output}"
    if outcome.skipped and not outcome.passed:
        pytest.skip(f"vLLM {version}: {outcome.skipped[0]}")
    # A check for what a release does not have yet skips on its own; the rest must pass.
    assert outcome.passed, outcome.output
