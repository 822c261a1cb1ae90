"""Issue 27, salts: cache salts are secrets, shown over the admin API to admins only.

Reads of the admin API on loopback are open (docs/admin.md), and /v1/tenants used to list
every scope's cache_salt to any local process. Tenants keep their users' prompts apart
with salts, so now only a request with an admin bearer sees them; everyone else (no
bearer, or an engine credential's) gets null and an id that tells scopes apart. Every
other read (status, which the dashboard draws, and the Prometheus exposition) and the
server's log of a clear carry no salt either.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from kvdepot.rpc.credentials import find_credential
from tests.support.credentials import credential_file
from tests.support.server import free_port, small_server

CHUNK = 64
PROMPT = list(range(3000, 3000 + CHUNK + 1))
BLOCKS = [0, 1, 2, 3]
ALPHA_SALT = "alpha-user-42-b7c1d"
OWNER_SALT = "owner-user-7-a9f3e"


def get(base: str, path: str, bearer: str | None = None) -> tuple[int, bytes]:
    """One real HTTP request; the status and the raw body."""
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    request = urllib.request.Request(base + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_salts_are_shown_to_admin_bearers_only(state_dir, engines_at):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = small_server(chunk_size=CHUNK, extra=("--admin-port", str(port))).start()
    try:
        alpha_path = credential_file(state_dir, "alpha", "engine", "alpha")
        alpha = engines_at(server.url, credentials=alpha_path)
        owner = engines_at(server.url)
        for i, engine in enumerate((alpha, owner)):
            engine.fill(seed=i)
        alpha.store("a", PROMPT, BLOCKS, 0, CHUNK, salt=ALPHA_SALT)
        owner.store("o", PROMPT, BLOCKS, 0, CHUNK, salt=OWNER_SALT)
        owner.store("p", PROMPT, BLOCKS, 0, CHUNK, salt="")
        owner_credential = find_credential(server.url)
        alpha_credential = find_credential(server.url, alpha_path)
        assert owner_credential is not None and alpha_credential is not None
        admin_bearer = owner_credential.admin_bearer()
        engine_bearer = alpha_credential.admin_bearer()

        # No bearer, and an engine credential's: the scopes, without their salts.
        for bearer in (None, engine_bearer):
            status, body = get(base, "/v1/tenants", bearer)
            assert status == 200
            assert ALPHA_SALT.encode() not in body and OWNER_SALT.encode() not in body
            answer = json.loads(body)
            assert answer["salts_shown"] is False
            scopes = answer["scopes"]
            assert len(scopes) == 3 and all(s["salt"] is None for s in scopes)
            # Scopes stay apart (an id per salt, stable across requests).
            assert len({s["salt_id"] for s in scopes}) == 3
            assert json.loads(get(base, "/v1/tenants", bearer)[1])["scopes"] == scopes
            for path in ("/v1/status", "/metrics", "/v1/quotas", "/openapi.json"):
                status, body = get(base, path, bearer)
                assert status == 200, path
                assert ALPHA_SALT.encode() not in body and OWNER_SALT.encode() not in body, path

        # An admin bearer sees them, with the same ids.
        status, body = get(base, "/v1/tenants", admin_bearer)
        assert status == 200
        answer = json.loads(body)
        assert answer["salts_shown"] is True
        assert sorted((s["tenant"], s["salt"]) for s in answer["scopes"]) == [
            ("", ""), ("", OWNER_SALT), ("alpha", ALPHA_SALT)]
        hidden = json.loads(get(base, "/v1/tenants")[1])["scopes"]
        assert ({s["salt_id"] for s in answer["scopes"]} == {s["salt_id"] for s in hidden})

        # An admin clearing a salt's scope: the log says a scope was cleared, not which salt.
        request = urllib.request.Request(
            base + "/v1/clear", method="POST", data=json.dumps({"cache_salt": OWNER_SALT}).encode(),
            headers={"Authorization": f"Bearer {admin_bearer}"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert json.loads(reply.read())["dropped"] == 1
    finally:
        output = server.stop()
    assert "admin API: cleared 1 chunks" in output
    assert OWNER_SALT not in output and ALPHA_SALT not in output
