"""The lmcache engine of `kvdepot bench e2e --device cuda`, the parts that need no GPU: its
engine list, the kv_transfer_config and server command it builds, and that a server that
fails or never gets ready is recorded as that engine's failure instead of ending the run."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvdepot.bench import e2e_gpu
from kvdepot.testbed.vllm_engine import lmcache_transfer_config


def _args(tmp_path: Path, **over: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    e2e_gpu.add_arguments(p)
    args = p.parse_args([])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_engines_accept_lmcache_beside_the_others_in_the_order_given() -> None:
    assert e2e_gpu.parse_engines("kvdepot,none,offload,lmcache") == [
        "kvdepot", "none", "offload", "lmcache"]
    assert "lmcache" in e2e_gpu.ENGINES
    with pytest.raises(ValueError, match="lmcachee"):
        e2e_gpu.parse_engines("none,lmcachee")


def test_kv_transfer_config_names_the_in_tree_connector_and_the_server() -> None:
    config = lmcache_transfer_config(41234)
    assert config["kv_connector"] == "LMCacheMPConnector"
    assert "kv_connector_module_path" not in config  # vLLM's own registration
    assert config["kv_role"] == "kv_both"
    # The connector joins these as "<host>:<port>" into a ZeroMQ endpoint.
    extra = config["kv_connector_extra_config"]
    assert f"{extra['lmcache.mp.host']}:{extra['lmcache.mp.port']}" == "tcp://127.0.0.1:41234"


def test_server_command_matches_kvdepot_s_memory_and_chunk_size() -> None:
    command = e2e_gpu.lmcache_server_command(41234, 41235, e2e_gpu.gib("32GiB"))
    assert command[:3] == [sys.executable, "-m", "lmcache.v1.multiprocess.http_server"]
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--port"] == "41234" and flags["--http-port"] == "41235"
    assert flags["--chunk-size"] == str(e2e_gpu.CHUNK_SIZE)
    assert flags["--l1-size-gb"] == "32"
    assert "--no-l1-use-lazy" in command and "LRU" in command


def test_a_server_that_exits_at_once_is_recorded_with_its_output(tmp_path: Path) -> None:
    vllm_log = tmp_path / "vllm.log"
    vllm_log.write_text("earlier engines' lines\n")
    command = [sys.executable, "-c",
               "import sys; print('ImportError: libcudart.so.13: cannot open', file=sys.stderr);"
               " sys.exit(3)"]

    def never(*_: object) -> None:
        raise AssertionError("no engine may start without a ready server")

    started = time.monotonic()
    result = e2e_gpu._run_lmcache(tmp_path, _args(tmp_path), vllm_log, command=command,
                                  engine=never)
    assert time.monotonic() - started < 1.5
    assert "exited with status 3" in result["error"]
    assert "libcudart.so.13: cannot open" in result["error"]
    assert "libcudart.so.13" in result["server_log_tail"]
    assert result["vllm_log_tail"] == ""  # only what was logged during this engine
    assert result["server_command"] == command and "ttft" not in result


def test_a_server_never_ready_is_stopped_and_recorded(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import time; print('pinning', flush=True); time.sleep(60)"]
    args = _args(tmp_path, lmcache_start_timeout=0.3)
    result = e2e_gpu._run_lmcache(tmp_path, args, tmp_path / "vllm.log", command=command)
    assert "did not answer" in result["error"] and "--lmcache-start-timeout" in result["error"]
    assert "pinning" in result["server_log_tail"]


def test_a_failed_engine_shows_in_the_table_and_the_summary(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"cold": 0.5, "vllm_hit": 0.05, "vllm_hit_same": True, "hit": 0.1,
             "hit_same": True, "hit_cached_tokens": 2048}]
    results = {"none": {"ttft": {2048: rows}},
               "offload": {"ttft": {2048: rows}},
               "lmcache": {"error": "Traceback ...\nRuntimeError: Unsupported GPUKVFormat: 7"}}
    summary = e2e_gpu._report(results, 50e9, 131072, [2048])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("tokens"))
    words = header.split()
    # Its column after offload's, and kvdepot's all-asynchronous one after it.
    assert words.index("offload") < words.index("lmcache") < words.index("async")
    assert summary["lengths"][2048]["offload_hit"] == pytest.approx(100.0)
    assert "lmcache_hit" not in summary["lengths"][2048]
    assert summary["failed"] == {"lmcache": results["lmcache"]["error"]}
    assert "Unsupported GPUKVFormat: 7" in out
    assert "offload hits 1 of 1" in out and "lmcache hits" not in out


def test_a_cause_logged_early_stays_in_a_long_server_output(tmp_path: Path) -> None:
    command = [sys.executable, "-c",
               "print('WARNING No compute backend loaded: undefined symbol: _ZN3c10');"
               "print('x' * 20000); raise SystemExit(1)"]
    result = e2e_gpu._run_lmcache(tmp_path, _args(tmp_path), tmp_path / "vllm.log",
                                  command=command)
    assert "undefined symbol: _ZN3c10" in result["error"]
    assert len(result["server_log_tail"]) < 10000


def test_an_lmcache_engine_recomputes_a_failed_load_instead_of_failing(tmp_path: Path) -> None:
    """Under vLLM's default policy one failed LMCache load (seen on the H100: its load for
    vLLM's own hit) failed its request and then ended the engine, losing every figure after
    it; kvdepot has vLLM recompute instead, and the peer is run the same way."""
    pytest.importorskip("vllm")
    args = _args(tmp_path, lmcache_port=41234)
    transfer = e2e_gpu.engine_options("lmcache", None, args)["kv_transfer_config"]
    assert transfer.kv_connector == "LMCacheMPConnector"
    assert transfer.kv_load_failure_policy == "recompute"
    assert transfer.kv_connector_extra_config["lmcache.mp.port"] == 41234


def _engine_measured_nothing(model_dir: Path, port: int, args: argparse.Namespace,
                             log_path: Path, out: Any) -> None:
    out.put({"ttft": {}, "connector_class": "LMCacheMPConnector"})


@pytest.mark.parametrize("fallback", [True, False], ids=["without_cuda_ops", "with_cuda_ops"])
def test_an_lmcache_server_without_its_cuda_extension_is_said_to_be(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        fallback: bool) -> None:
    """LMCache falls back to torch operations when its CUDA extension does not import (on
    the GPU machine's torch 2.11), and only says so in its log: the bench must, beside its
    figures, or they read as LMCache's own."""
    ports = [e2e_gpu.free_port(), e2e_gpu.free_port()]
    monkeypatch.setattr(e2e_gpu, "free_port", lambda: ports.pop(0))
    http_port = ports[1]
    warning = f"WARNING: {e2e_gpu.LMCACHE_WITHOUT_CUDA_OPS}; " if fallback else ""
    server = ("import http.server\n"
              f"print({warning + 'LMCache INFO: started'!r}, flush=True)\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers()\n"
              "    def log_message(self, *a):\n"
              "        pass\n"
              f"http.server.HTTPServer(('127.0.0.1', {http_port}), H).serve_forever()\n")
    result = e2e_gpu._run_lmcache(tmp_path, _args(tmp_path), tmp_path / "vllm.log",
                                  command=[sys.executable, "-c", server],
                                  engine=_engine_measured_nothing)
    assert "error" not in result, result.get("error")
    assert result["cuda_ops"] is not fallback
    summary = e2e_gpu._report({"none": {"ttft": {}}, "lmcache": result}, 50e9, 131072, [])
    out = capsys.readouterr().out
    assert ("lmcache: measured without its CUDA extension" in out) is fallback
    assert summary.get("without_cuda_ops", []) == (["lmcache"] if fallback else [])
