"""Issue 24, part 3: a broken or hostile request never takes an engine down.

A real vLLM OpenAI server with KVDepotConnector gets requests a client can send at will:
a 64 KiB cache_salt, one with control characters, one with non-ASCII text, a prompt past
what the engine accepts. Each is answered (computed without the cache, or refused by vLLM
itself with a 400), the engine stays up, and afterwards a cached prompt still hits.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CHUNK, DepotServer, delta, eventually, free_port, tokens

from kvdepot.bench.openai_server import OpenAIServer, api_server_argv, api_server_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 2048
PROMPT = tokens(3101, 3 * CHUNK + 40)


@pytest.fixture(scope="module")
def api(model_dir: Path, server: DepotServer, log_dir: Path) -> Iterator[OpenAIServer]:
    port = free_port()
    argv = api_server_argv(model_dir, port, server.url, 256 << 20, MAX_MODEL_LEN)
    with OpenAIServer(argv, api_server_env(), port, log_dir / "hostile-api.log") as server_:
        yield server_


def complete(api: OpenAIServer, prompt: list[int], **extra: object) -> tuple[int, dict]:
    """A plain (not streamed) greedy completion: (HTTP status, JSON body)."""
    body = {"model": api.model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    request = urllib.request.Request(api.base + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def healthy(api: OpenAIServer) -> bool:
    with urllib.request.urlopen(api.base + "/health", timeout=30) as reply:
        return reply.status == 200


def answer_tokens(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


def test_hostile_requests_are_answered_and_later_requests_still_hit(
        api: OpenAIServer, server: DepotServer) -> None:
    before = server.stats()
    status, first = complete(api, PROMPT)
    assert status == 200, first
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 3)

    hostile = {
        "a 64 KiB salt": {"cache_salt": "s" * (64 << 10)},
        "control characters": {"cache_salt": "a\x00b\x07c\nd\x1b[31m"},
    }
    for what, extra in hostile.items():
        api.reset_prefix_cache()
        before = server.stats()
        status, body = complete(api, PROMPT, **extra)
        # vLLM may refuse a salt itself (a 400); anything else must be an answer.
        assert status in (200, 400), (what, status, body)
        if status == 200:
            assert len(answer_tokens(body)) == 4, what
        after = server.stats()
        # Never sent to the server, never stored under a salt it would refuse.
        assert delta(after, before, "lookups") == 0, what
        assert delta(after, before, "hit_tokens") == 0, what
        assert healthy(api), what

    # A prompt past the engine's length: vLLM's own 400, the engine unharmed.
    status, body = complete(api, tokens(3102, MAX_MODEL_LEN + 100))
    assert status == 400, body
    assert healthy(api)

    # Non-ASCII text is a salt like any other: stored under it, and hit under it only.
    salt = "ключ-日本語-🔑"
    before = server.stats()
    status, salted = complete(api, PROMPT, cache_salt=salt)
    assert status == 200, salted
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 3)
    api.reset_prefix_cache()
    before = server.stats()
    status, again = complete(api, PROMPT, cache_salt=salt)
    assert status == 200 and answer_tokens(again) == answer_tokens(salted)
    assert delta(server.stats(), before, "hit_tokens") == 3 * CHUNK

    # And the unsalted prompt stored before all this still hits.
    api.reset_prefix_cache()
    before = server.stats()
    status, last = complete(api, PROMPT)
    assert status == 200 and answer_tokens(last) == answer_tokens(first)
    assert delta(server.stats(), before, "hit_tokens") == 3 * CHUNK
