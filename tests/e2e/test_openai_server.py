"""vLLM's OpenAI server, started exactly as docs/connector.md says, loads from kvdepot."""

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CHUNK, DepotServer, delta, eventually, free_port, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

DOC = Path(__file__).parents[2] / "docs" / "connector.md"
MARKER = "<!-- tests/e2e/test_openai_server.py runs the next block's server command -->"
DOC_PORT, DOC_URL = "8000", "tcp://127.0.0.1:5555"
START_TIMEOUT = 420.0
PROMPT = tokens(0, 3 * CHUNK + 40)


def documented_command() -> list[str]:
    """The marked block's last command (the api_server), as shell words."""
    block = DOC.read_text().split(MARKER, 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines(keepends=True)
    (start,) = [i for i, ln in enumerate(lines) if "vllm.entrypoints.openai.api_server" in ln]
    return shlex.split("".join(lines[start:]))


def as_subprocess(words: list[str], model: Path, port: int, url: str
                  ) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) for the documented words, with our ports, server and model."""
    env = dict(os.environ)
    while re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], words
    argv = [sys.executable, *words[1:]]
    argv = [str(model) if w == "$MODEL" else w.replace(DOC_URL, url) for w in argv]
    argv[argv.index("--port") + 1] = str(port)
    assert DOC_PORT not in argv and "$MODEL" not in argv
    return argv, env


class OpenAIServer:
    def __init__(self, argv: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self._log = open(log, "wb")  # noqa: SIM115
        self._proc = subprocess.Popen(argv, env=env, stdout=self._log,
                                      stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self._proc.returncode}; "
                                   f"see {log}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the vLLM server did not come up; see {log}")
            time.sleep(1)

    def post(self, path: str, body: dict | None = None) -> urllib.request.Request:
        data = json.dumps(body or {}).encode()
        return urllib.request.Request(self.base + path, data,
                                      {"Content-Type": "application/json"})

    def stream_completion(self, model: Path, prompt: list[int]) -> list[int]:
        """Greedy token ids, read from the server-sent events as they arrive."""
        request = self.post("/v1/completions", {
            "model": str(model), "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "stream": True, "return_token_ids": True})
        ids: list[int] = []
        events = 0
        with urllib.request.urlopen(request, timeout=300) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events += 1
                ids += json.loads(line[len("data: "):])["choices"][0]["token_ids"] or []
        assert events > 1, "the answer was not streamed"
        return ids

    def reset_prefix_cache(self) -> None:
        # Blocks of a finished request stay held until its stores to kvdepot are done.
        deadline = time.monotonic() + 60
        while True:
            with urllib.request.urlopen(self.post("/reset_prefix_cache"), timeout=30) as reply:
                if json.load(reply)["success"]:
                    return
            assert time.monotonic() < deadline, "vLLM kept refusing to reset its prefix cache"
            time.sleep(0.1)

    def tokens_by_source(self) -> dict[str, float]:
        """vLLM's `vllm:prompt_tokens_by_source_total` counter, by source."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as reply:
            text = reply.read().decode()
        pattern = r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$'
        return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(30)
        self._log.close()


@pytest.fixture(scope="module")
def openai_server(model_dir: Path, server: DepotServer, log_dir: Path
                  ) -> Iterator[OpenAIServer]:
    port = free_port()
    argv, env = as_subprocess(documented_command(), model_dir, port, server.url)
    api = OpenAIServer(argv, env, port, log_dir / "openai-server.log")
    yield api
    api.close()


def test_the_documented_command_is_the_one_started() -> None:
    words = documented_command()
    assert "--kv-transfer-config" in words
    config = json.loads(words[words.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVDepotConnector"
    assert config["kv_connector_extra_config"]["kvdepot.url"] == DOC_URL


def test_second_streamed_completion_loads_from_kvdepot(
    openai_server: OpenAIServer, server: DepotServer, model_dir: Path
) -> None:
    before = server.stats()
    first = openai_server.stream_completion(model_dir, PROMPT)
    assert len(first) == 8
    stored = eventually(server, lambda s: delta(s, before, "stored_chunks") == 3)
    openai_server.reset_prefix_cache()
    vllm_before = openai_server.tokens_by_source()
    assert vllm_before["external_kv_transfer"] == 0

    second = openai_server.stream_completion(model_dir, PROMPT)
    assert second == first
    after = server.stats()
    assert delta(after, stored, "hit_tokens") == 3 * CHUNK
    assert delta(after, stored, "retrieved_chunks") == 3
    # vLLM counts a finished request's prompt tokens by where they came from.
    deadline = time.monotonic() + 30
    while (vllm_after := openai_server.tokens_by_source())[
            "external_kv_transfer"] == vllm_before["external_kv_transfer"]:
        assert time.monotonic() < deadline, vllm_after
        time.sleep(0.2)
    assert vllm_after["external_kv_transfer"] - vllm_before["external_kv_transfer"] == 3 * CHUNK
    assert vllm_after["local_cache_hit"] == vllm_before["local_cache_hit"]
    assert (vllm_after["local_compute"] - vllm_before["local_compute"]
            == len(PROMPT) - 3 * CHUNK)
