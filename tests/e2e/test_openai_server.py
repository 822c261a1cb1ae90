"""vLLM's OpenAI server, started exactly as docs/connector.md says, loads from kvdepot."""

import json
import os
import re
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.testbed.openai_server import OpenAIServer
from kvdepot.testbed.server_process import free_port
from tests.e2e.support.harness import CHUNK, DepotServer, delta, eventually, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

DOC = Path(__file__).parents[2] / "docs" / "connector.md"
MARKER = "<!-- tests/e2e/test_openai_server.py runs the next block's server command -->"
DOC_PORT, DOC_URL = "8000", "tcp://127.0.0.1:5555"
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


@pytest.fixture(scope="module")
def openai_server(model_dir: Path, server: DepotServer, log_dir: Path
                  ) -> Iterator[OpenAIServer]:
    port = free_port()
    argv, env = as_subprocess(documented_command(), model_dir, port, server.url)
    with OpenAIServer(argv, env, port, log_dir / "openai-server.log") as api:
        yield api


def test_the_documented_command_is_the_one_started() -> None:
    words = documented_command()
    assert "--kv-transfer-config" in words
    config = json.loads(words[words.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVDepotConnector"
    assert config["kv_connector_extra_config"]["kvdepot.url"] == DOC_URL


def test_second_streamed_completion_loads_from_kvdepot(
    openai_server: OpenAIServer, server: DepotServer
) -> None:
    before = server.stats()
    first = openai_server.complete(PROMPT, 8)
    assert first.events > 1, "the answer was not streamed"
    assert len(first.token_ids) == 8
    stored = eventually(server, lambda s: delta(s, before, "stored_chunks") == 3
                        and delta(s, before, "stored_tails") == 1)
    openai_server.reset_prefix_cache()
    vllm_before = openai_server.prompt_tokens_by_source()
    assert vllm_before["external_kv_transfer"] == 0

    second = openai_server.complete(PROMPT, 8)
    assert second.token_ids == first.token_ids
    after = server.stats()
    assert delta(after, stored, "hit_tokens") == 3 * CHUNK + 40  # the chunks and the tail
    assert delta(after, stored, "retrieved_chunks") == 3
    # vLLM counts a finished request's prompt tokens by where they came from.
    deadline = time.monotonic() + 30
    while (vllm_after := openai_server.prompt_tokens_by_source())[
            "external_kv_transfer"] == vllm_before["external_kv_transfer"]:
        assert time.monotonic() < deadline, vllm_after
        time.sleep(0.2)
    # All but the prompt's last token came from kvdepot.
    assert (vllm_after["external_kv_transfer"] - vllm_before["external_kv_transfer"]
            == len(PROMPT) - 1)
    assert vllm_after["local_cache_hit"] == vllm_before["local_cache_hit"]
    assert vllm_after["local_compute"] - vllm_before["local_compute"] == 1
