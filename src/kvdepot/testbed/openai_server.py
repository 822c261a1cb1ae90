"""vLLM's OpenAI-compatible HTTP server as a user runs it, and a streaming client for it.

The server is `python -m vllm.entrypoints.openai.api_server` with the flags
docs/connector.md documents; the client sends token-id prompts (the benchmark model has
no tokenizer), streams the answer and times the first token itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from kvdepot.testbed.vllm_engine import kv_transfer_config

START_TIMEOUT = 600.0
"""Seconds a vLLM server may take to come up (a loaded two-core machine needs minutes)."""


@dataclass
class Answer:
    """One streamed completion, timed by the client."""

    sent: float
    """perf_counter() when the request was sent."""
    ttft: float
    """Seconds from sending to the first streamed token."""
    finished: float
    """perf_counter() when the last event arrived."""
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens the engine did not compute (its prefix cache and kvdepot together)."""
    events: int


def api_server_argv(model_dir: Path, port: int, kvdepot_url: str | None,
                    kv_cache_bytes: int, max_model_len: int,
                    kv_events_to: str | None = None,
                    connector_options: dict[str, Any] | None = None) -> list[str]:
    """The documented api_server command, with vLLM's own KV cache set to
    `kv_cache_bytes` and KVDepotConnector at `kvdepot_url` (None: no connector; its
    `connector_options` as "kvdepot.<name>" keys); with `kv_events_to`, publishing KV
    events to that ZeroMQ address (vLLM connects its PUB socket to a host's address, and
    binds one given as tcp://*:PORT)."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--skip-tokenizer-init", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
            "--max-model-len", str(max_model_len),
            "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--enable-prompt-tokens-details", "--enforce-eager"]
    if kvdepot_url is not None:
        argv += ["--kv-transfer-config",
                 json.dumps(kv_transfer_config(kvdepot_url, connector_options))]
    if kv_events_to is not None:
        argv += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events_to})]
    return argv


def api_server_env() -> dict[str, str]:
    env = dict(os.environ)
    # VLLM_CPU_KVCACHE_SPACE (whole GiB) would override --kv-cache-memory-bytes.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    env["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


class OpenAIServer:
    """A running api_server; `close()` (or leaving the `with` block) stops it."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int, log_path: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.model = argv[argv.index("--model") + 1]
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in close())
        self._proc = subprocess.Popen(argv, env=env, stdout=self._log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_healthy()
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with status {self._proc.returncode}"
                                   f"; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the vLLM server did not come up in {START_TIMEOUT:.0f} s; "
                                   f"see {self.log_path}")
            time.sleep(1)

    def _post(self, path: str, body: dict) -> urllib.request.Request:
        return urllib.request.Request(self.base + path, json.dumps(body).encode(),
                                      {"Content-Type": "application/json"})

    def complete(self, prompt: list[int], max_tokens: int) -> Answer:
        """Greedy completion of exactly `max_tokens` tokens, streamed."""
        request = self._post("/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}})
        ids: list[int] = []
        usage: dict = {}
        events = 0
        first = 0.0
        sent = time.perf_counter()
        with urllib.request.urlopen(request, timeout=3600) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                events += 1
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    new = choice.get("token_ids") or []
                    if new and not ids:
                        first = time.perf_counter()
                    ids += new
        finished = time.perf_counter()
        if not ids:
            raise RuntimeError("the vLLM server streamed no token")
        details = usage.get("prompt_tokens_details") or {}
        return Answer(sent, first - sent, finished, ids, int(usage.get("prompt_tokens", 0)),
                      int(details.get("cached_tokens") or 0), events)

    def reset_prefix_cache(self, timeout: float = 60.0) -> None:
        """Empty vLLM's own prefix cache (refused while finished requests' blocks are still
        held, which they are until kvdepot has stored them)."""
        deadline = time.monotonic() + timeout
        while True:
            with urllib.request.urlopen(self._post("/reset_prefix_cache", {}),
                                        timeout=60) as reply:
                if json.load(reply).get("success"):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM kept refusing to reset its prefix cache")
            time.sleep(0.1)

    def prompt_tokens_by_source(self) -> dict[str, float]:
        """vLLM's `vllm:prompt_tokens_by_source_total`, summed by source."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=60) as reply:
            text = reply.read().decode()
        pattern = r'^vllm:prompt_tokens_by_source_total\{([^}]*)\} (\S+)$'
        totals: dict[str, float] = {}
        for match in re.finditer(pattern, text, re.MULTILINE):
            source = re.search(r'source="(\w+)"', match[1])
            if source:
                totals[source[1]] = totals.get(source[1], 0.0) + float(match[2])
        return totals

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(30)
        self._log.close()

    def __enter__(self) -> OpenAIServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
