"""The server and the engine see the GPUs under different CUDA_VISIBLE_DEVICES: the server
must find the engine's GPU by UUID, and its copies must run on that physical GPU.

In both cases the engine's GPU is its own cuda:0 but the server's cuda:1, so a server that
trusted the engine's device index would map (through peer access, where the GPUs have it)
and stage on the wrong GPU; round trips could even come back exact. So besides the bytes,
the test checks where the server's memory went: its staging buffers (two 20 MiB segments
of torch's caching allocator at least) must not appear on the other GPU, and, where
nvidia-smi lists the server's process, the server must hold memory on the engine's GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.gpu.support.depot_server import child_env, script, start_server

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason="needs at least two visible GPUs")

ROUNDS = 6
STRAY_LIMIT = 16 << 20
"""Memory the server may take on the GPU that is not the engine's while serving it (none
is expected; a misplaced staging buffer alone is 20 MiB)."""


def _uuid(index: int) -> str:
    """The UUID as the engine reports it (and the server matches it)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _visible(uuid: str) -> str:
    """The form CUDA_VISIBLE_DEVICES takes (`GPU-` and the UUID)."""
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def _free(index: int) -> int:
    return torch.cuda.mem_get_info(index)[0]


def _gpu_processes() -> list[tuple[int, str]] | None:
    """(pid, GPU uuid) of every compute process nvidia-smi lists, None if it cannot tell."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    rows = []
    for line in out.splitlines():
        pid, _, uuid = line.partition(",")
        if pid.strip().isdigit():
            rows.append((int(pid), uuid.strip()))
    return rows


@pytest.mark.parametrize("server_view", ["reversed", "inherited"])
def test_server_finds_the_engines_gpu_by_uuid(server_view: str, tmp_path: Path) -> None:
    uuids = [_uuid(i) for i in range(torch.cuda.device_count())]
    if server_view == "reversed":
        # Server: CUDA_VISIBLE_DEVICES=<gpu 1>,<gpu 0>; engine: <gpu 0>.
        server_env = {"CUDA_VISIBLE_DEVICES": f"{_visible(uuids[1])},{_visible(uuids[0])}"}
        engine_uuid, other_uuid = uuids[0], uuids[1]
    else:
        # Server: this process's view (on a bare machine, unset: every GPU); engine: gpu 1.
        server_env = {}
        engine_uuid, other_uuid = uuids[1], uuids[0]
    other = uuids.index(other_uuid)
    for index in range(2):
        _free(index)  # this process's own context on both GPUs, before the baseline
    server = start_server("auto", tmp_path / "server.log", server_env)
    try:
        time.sleep(1.0)  # the server's CUDA start-up (its page-locked pool) is done
        other_before = _free(other)
        env = child_env()
        env["CUDA_VISIBLE_DEVICES"] = _visible(engine_uuid)
        engine = subprocess.run(
            script("engine", server.url, "mla", "31", str(ROUNDS)),
            env=env, capture_output=True, text=True, timeout=240)
        assert engine.returncode == 0, engine.stdout + engine.stderr
        assert f"ok {ROUNDS}" in engine.stdout  # every round trip was bit-exact

        log = (tmp_path / "server.log").read_text()
        assert f"engine KV cache on GPU {engine_uuid}: this server's cuda:1" in log, log
        stray = other_before - _free(other)
        assert stray < STRAY_LIMIT, (
            f"the server took {stray >> 20} MiB on GPU {other_uuid}, not the engine's GPU")
        listed = _gpu_processes()
        mine = [u for pid, u in listed or [] if pid == server.proc.pid]
        print(f"nvidia-smi lists the server (pid {server.proc.pid}) on {mine or 'no GPU'}; "
              f"engine on {engine_uuid}, {stray >> 20} MiB taken on the other GPU")
        if mine:  # nvidia-smi sees this pid namespace: the server must be on the engine's GPU
            assert _visible(engine_uuid) in mine, f"server on {mine}, engine on {engine_uuid}"
        elif os.environ.get("KVDEPOT_REQUIRE_NVIDIA_SMI"):
            pytest.fail(f"nvidia-smi did not list the server process: {listed}")
        assert server.alive()
    finally:
        server.stop()
