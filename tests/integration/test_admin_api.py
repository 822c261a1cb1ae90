"""The HTTP admin API (issue 12, item 1) against real `kvdepot serve` processes: what each
endpoint reports against what engines did, scoped clearing, who may call what on a
loopback and on a TLS listener beyond it, bad input, and the OpenAPI schema."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.client.admin import AdminClient
from kvdepot.client.admin_api import AdminAPI, AdminAPIError
from kvdepot.rpc.auth import remove_credential
from kvdepot.server.admin_api import build_app
from kvdepot.testbed.server_process import ServerProcess
from tests.support.credentials import credential_file
from tests.support.server import free_port, small_server
from tests.support.tls import self_signed_certificate

CHUNK = 64
PROMPT = list(range(1000, 1000 + 3 * CHUNK + 1))
OTHER = list(range(7000, 7000 + 3 * CHUNK + 1))
BLOCKS = list(range(12))
DASHBOARD = Path(__file__).parents[2] / "src/kvdepot/server/dashboard"


def admin_server(*extra: str) -> ServerProcess:
    port = free_port()
    server = small_server(chunk_size=CHUNK, extra=("--admin-port", str(port), *extra))
    server.admin_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return server


@pytest.fixture
def server(state_dir) -> Iterator[ServerProcess]:
    with admin_server() as srv:
        yield srv


def api(server: ServerProcess, credentials: str | None = None) -> AdminAPI:
    return AdminAPI(server.admin_url, url=server.url, credentials=credentials)


def anonymous_call(base: str, method: str, path: str, body: bytes | None = None,
                   headers: dict[str, str] | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(base + path, data=body, method=method,
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ---- what the endpoints report --------------------------------------------------------------
def test_status_reports_what_engines_did(server, engines_at):
    admin = api(server)
    health, ready = admin.call("GET", "/healthz"), admin.call("GET", "/readyz")
    assert health[0] == 200 and health[1]["status"] == "ok"
    assert ready[0] == 200 and ready[1]["ready"] is True
    assert "control loop" in health[1]["means"] and "new engine" in ready[1]["means"]
    engine = engines_at(server.url, num_blocks=32)
    engine.fill(seed=1)
    engine.store("s", PROMPT, BLOCKS, 0, 3 * CHUNK)
    assert engine.lookup("l", PROMPT[:2 * CHUNK + 1]) == 2 * CHUNK  # its locks stay held

    status = admin.status()
    with AdminClient(server.url) as zmq_admin:
        stats = zmq_admin.stats()
    cpu = status["tiers"][0]
    assert cpu["name"] == "cpu" and cpu["chunks"] == stats["chunks"] == 3
    assert cpu["used_bytes"] == stats["used_bytes"] > 0
    assert cpu["capacity_bytes"] == stats["capacity_bytes"]
    (registered,) = status["engines"]
    assert registered["model"] == "test-model" and registered["memory"] == "cpu"
    assert registered["layout"]["block_size"] == 16 and registered["layout"]["num_blocks"] == 32
    assert registered["layout"]["layers"] == 3  # two layers and an alias of one
    assert "instance_id" not in json.dumps(status)  # the registration id is a secret
    assert status["sessions"]["lookup_jobs"] == 1
    assert status["locks"]["locked_keys"] == 2
    assert status["counters"]["stored_chunks"] == 3 and status["counters"]["lookups"] == 1
    assert status["chunk_size"] == CHUNK and status["url"] == server.url
    assert status["tenants"][""]["chunks"] == 3
    assert status["draining"] is False and status["uptime_seconds"] > 0

    # The Prometheus exposition on the same port says the same.
    with urllib.request.urlopen(server.admin_url + "/metrics", timeout=10) as r:
        exposition = r.read().decode()
    assert "kvdepot_chunks 3.0" in exposition
    assert "kvdepot_stored_chunks_total 3.0" in exposition


def test_clear_by_model_tenant_and_salt(state_dir, server, engines_at):
    alpha_cred = credential_file(state_dir, "alpha", "engine", "alpha")
    owner = engines_at(server.url)
    other_model = engines_at(server.url, model="other-model")
    alpha = engines_at(server.url, credentials=alpha_cred)
    for i, engine in enumerate((owner, other_model, alpha)):
        engine.fill(seed=i)
    owner.store("a", PROMPT, BLOCKS, 0, 3 * CHUNK, salt="s1")
    owner.store("b", OTHER, BLOCKS, 0, 3 * CHUNK, salt="s2")
    other_model.store("c", PROMPT, BLOCKS, 0, 3 * CHUNK, salt="s1")
    alpha.store("d", PROMPT, BLOCKS, 0, 3 * CHUNK, salt="s1")
    admin = api(server)
    assert admin.status()["tiers"][0]["chunks"] == 12
    scopes = admin.call("GET", "/v1/tenants")[1]["scopes"]
    assert sorted((s["tenant"], s["model"], s["salt"], s["chunks"]) for s in scopes) == [
        ("", "other-model", "s1", 3), ("", "test-model", "s1", 3), ("", "test-model", "s2", 3),
        ("alpha", "test-model", "s1", 3)]

    assert admin.clear(cache_salt="s2") == 3
    assert owner.lookup("q1", OTHER, salt="s2") == 0
    assert owner.lookup("q2", PROMPT, salt="s1") == 3 * CHUNK
    owner.call("scheduler", "end_session", "q2")
    assert admin.clear(model="other-model") == 3
    assert other_model.lookup("q3", PROMPT, salt="s1") == 0
    assert alpha.lookup("q4", PROMPT, salt="s1") == 3 * CHUNK
    alpha.call("scheduler", "end_session", "q4")
    assert admin.clear(tenant="alpha") == 3
    assert alpha.lookup("q5", PROMPT, salt="s1") == 0
    # Chunks a lookup holds locked are kept by a clear.
    assert owner.lookup("q6", PROMPT[:2 * CHUNK + 1], salt="s1") == 2 * CHUNK
    assert admin.clear(tenant="", cache_salt="s1") == 1  # the owner's unlocked third chunk
    assert admin.clear(model="no-such-model") == 0
    owner.call("scheduler", "end_session", "q6")
    assert admin.clear() == 2
    assert admin.status()["tiers"][0]["chunks"] == 0


def test_quotas_and_tenants(server):
    admin = api(server)
    assert admin.quotas() == {}
    admin.set_quota("team-a", 1 << 30)
    admin.set_quota("*", 4096)  # the default of every named tenant
    assert admin.quota("team-a") == 1 << 30
    assert admin.quota("team-b") is None
    assert admin.quotas() == {"team-a": 1 << 30, "*": 4096}
    with pytest.raises(AdminAPIError, match="HTTP 400"):  # the owner's space has none
        admin.set_quota("", 4096)
    assert admin.tenants()["team-a"]["quota_cpu_bytes"] == 1 << 30
    admin.set_quota("team-a", None)
    assert admin.quota("team-a") is None
    assert "team-a" not in admin.quotas()


def test_log_level_changes_what_the_server_logs(server):
    admin = api(server)
    admin.set_log_level("WARNING", "kvdepot.server.admin_api")
    admin.clear()  # logged at INFO: not printed now
    admin.set_log_level("INFO", "kvdepot.server.admin_api")
    admin.clear(model="after")
    admin.set_log_level("DEBUG")
    printed = server.stop()
    assert "cleared 0 chunks (scope all)" not in printed
    assert "log level of the root logger set to DEBUG" in printed
    assert "cleared 0 chunks (scope {'model': 'after'})" in printed


# ---- who may call what ------------------------------------------------------------------------
MUTATIONS = [("POST", "/v1/clear", b"{}"), ("PUT", "/v1/quotas/t", b'{"cpu_bytes": 1}'),
             ("PUT", "/v1/log-level", b'{"level": "INFO"}')]
READS = ["/v1/status", "/v1/tenants", "/v1/quotas", "/v1/quotas/t", "/metrics"]
PROBES = ["/healthz", "/readyz"]


def bearer(path: str | None, server: ServerProcess) -> dict[str, str]:
    from kvdepot.rpc.credentials import find_credential

    found = find_credential(server.url, path)
    assert found is not None
    return {"Authorization": f"Bearer {found.admin_bearer()}"}


def test_on_loopback_reads_are_open_and_changes_need_an_admin(state_dir, server):
    engine_cred = credential_file(state_dir, "eng", "engine", "t")
    ops_cred = credential_file(state_dir, "ops", "admin", "")
    base = server.admin_url
    for path in PROBES:
        assert anonymous_call(base, "GET", path)[0] == 200
    for path in READS[:-1]:
        assert anonymous_call(base, "GET", path)[0] == 200
    for method, path, body in MUTATIONS:
        status, answer = anonymous_call(base, method, path, body)
        assert status == 401 and "Bearer" in answer["error"]
        assert anonymous_call(base, method, path, body, bearer(engine_cred, server))[0] == 403
        assert anonymous_call(base, method, path, body, bearer(ops_cred, server))[0] == 200
        assert anonymous_call(base, method, path, body, bearer(None, server))[0] == 200
        forged = {"Authorization": "Bearer ops." + "0" * 64}
        assert anonymous_call(base, method, path, body, forged)[0] == 401
    # A credential removed from the state directory stops working within a second or so.
    ops = bearer(ops_cred, server)
    remove_credential(state_dir, "ops")
    import time
    deadline = time.monotonic() + 10
    while anonymous_call(base, "POST", "/v1/clear", b"{}", ops)[0] != 401:
        assert time.monotonic() < deadline, "a removed credential still works"
        time.sleep(0.2)


@pytest.fixture
def tls_files(tmp_path) -> tuple[str, str]:
    return self_signed_certificate(tmp_path)


def test_beyond_loopback_every_endpoint_needs_a_bearer_over_tls(state_dir, tls_files):
    cert, key = tls_files
    engine_cred = credential_file(state_dir, "eng", "engine", "t")
    port = free_port()
    server = small_server(chunk_size=CHUNK, extra=(
        "--admin-port", str(port), "--admin-host", "0.0.0.0", "--admin-tls-cert", cert,
        "--admin-tls-key", key))
    with server:
        import ssl
        context = ssl.create_default_context(cafile=cert)
        base = f"https://127.0.0.1:{port}"

        def call(method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None) -> int:
            request = urllib.request.Request(base + path, data=body, method=method,
                                             headers=headers or {})
            try:
                with urllib.request.urlopen(request, timeout=10, context=context) as r:
                    return r.status
            except urllib.error.HTTPError as exc:
                return exc.code

        engine, owner = bearer(engine_cred, server), bearer(None, server)
        for path in PROBES + READS:
            assert call("GET", path) == 401, path
            assert call("GET", path, headers=owner) == 200, path
        for path in PROBES:
            assert call("GET", path, headers=engine) == 200
        for path in READS:
            assert call("GET", path, headers=engine) == 403
        for method, path, body in MUTATIONS:
            assert call(method, path, body) == 401
            assert call(method, path, body, engine) == 403
            assert call(method, path, body, owner) == 200
        # The CLI with the server's CA.
        printed = subprocess.run(
            [sys.executable, "-m", "kvdepot.cli", "status", "--admin-url", base, "--url",
             server.url, "--ca", cert], capture_output=True, text=True, timeout=60)
        assert printed.returncode == 0, printed.stderr
        assert "cpu" in printed.stdout and "no engines registered" in printed.stdout


def test_beyond_loopback_without_tls_the_server_refuses_to_start(state_dir):
    result = subprocess.run(
        [sys.executable, "-m", "kvdepot.cli", "serve", "--port", str(free_port()),
         "--l1-size", "64MiB", "--admin-port", str(free_port()), "--admin-host", "0.0.0.0"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "without TLS" in result.stderr


def test_a_bad_certificate_fails_the_start(state_dir, tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate\n")
    result = subprocess.run(
        [sys.executable, "-m", "kvdepot.cli", "serve", "--port", str(free_port()),
         "--l1-size", "64MiB", "--admin-port", str(free_port()), "--admin-tls-cert", str(cert),
         "--admin-tls-key", str(cert)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "cannot load --admin-tls-cert" in result.stderr


def test_a_taken_admin_port_fails_the_start(state_dir, server):
    port = int(server.admin_url.rsplit(":", 1)[1])
    result = subprocess.run(
        [sys.executable, "-m", "kvdepot.cli", "serve", "--port", str(free_port()),
         "--l1-size", "64MiB", "--admin-port", str(port)],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "cannot serve the admin API" in result.stderr


def test_insecure_serves_everyone(state_dir):
    with admin_server("--insecure") as server:
        for method, path, body in MUTATIONS:
            assert anonymous_call(server.admin_url, method, path, body)[0] == 200


# ---- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "path", "body", "status", "says"), [
    ("POST", "/v1/clear", b"[1]", 400, "JSON object"),
    ("POST", "/v1/clear", b"{not json", 400, "not JSON"),
    ("POST", "/v1/clear", b'{"models": "x"}', 400, "unknown fields"),
    ("POST", "/v1/clear", b'{"model": 3}', 400, "model must be str"),
    ("POST", "/v1/clear", b"{" + b" " * (70 << 10) + b"}", 413, "at most"),
    ("PUT", "/v1/quotas/bad%20name", b'{"cpu_bytes": 1}', 400, "is not allowed"),
    ("PUT", "/v1/quotas/t", b'{"cpu_bytes": -1}', 400, ">= 0"),
    ("PUT", "/v1/quotas/t", b'{"cpu_bytes": true}', 400, "int or null"),
    ("PUT", "/v1/quotas/t", b"{}", 400, "give cpu_bytes"),
    ("PUT", "/v1/log-level", b'{"level": "LOUD"}', 400, "level must be one of"),
    ("PUT", "/v1/log-level", b'{"level": "INFO", "logger": "uvicorn"}', 400, "kvdepot's"),
])
def test_bad_input_gets_a_clear_error(server, method, path, body, status, says):
    got, answer = anonymous_call(server.admin_url, method, path, body, bearer(None, server))
    assert got == status and says in answer["error"]
    assert api(server).call("GET", "/healthz")[0] == 200


# ---- the schema --------------------------------------------------------------------------------
def test_every_route_is_in_the_openapi_schema(server):
    from kvdepot.options import Options
    from kvdepot.server.admin_api import AdminState

    schema = json.loads((DASHBOARD / "openapi.json").read_text())
    assert schema["openapi"].startswith("3.")
    app = build_app(AdminState(Options(), auth=None))  # type: ignore[arg-type]
    documented = {(path, method.upper()) for path, item in schema["paths"].items()
                  for method in item}
    served = set()
    for route in app.routes:
        for method in getattr(route, "methods", None) or []:
            if method != "HEAD":
                served.add((route.path, method))
    assert served - {("/", "GET"), ("/openapi.json", "GET")} <= documented
    assert documented <= served
    with urllib.request.urlopen(server.admin_url + "/openapi.json", timeout=10) as r:
        assert json.loads(r.read()) == schema


# ---- the commands ----------------------------------------------------------------------------
def kvdepot(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvdepot.cli", *args, "--admin-url",
                           server.admin_url, "--url", server.url],
                          capture_output=True, text=True, timeout=60)


def test_status_top_quota_and_clear_commands(server, engines_at):
    engine = engines_at(server.url)
    engine.fill(seed=2)
    engine.store("s", PROMPT, BLOCKS, 0, 3 * CHUNK, salt="x")
    shown = kvdepot(server, "status")
    assert shown.returncode == 0, shown.stderr
    assert "cpu" in shown.stdout and "test-model" in shown.stdout and "0/1" in shown.stdout
    raw = json.loads(kvdepot(server, "status", "--json").stdout)
    assert raw["tiers"][0]["chunks"] == 3
    top = kvdepot(server, "top", "--iterations", "2", "--interval", "0.2")
    assert top.returncode == 0 and "per second: lookups" in top.stdout
    assert kvdepot(server, "quota", "team-a", "--set", "2GiB").stdout.strip() == \
        "team-a\t2.0 GiB"
    assert kvdepot(server, "quota").stdout.strip() == "team-a\t2.0 GiB"
    assert kvdepot(server, "quota", "team-a", "--remove").stdout.strip() == "team-a\tno quota"
    assert kvdepot(server, "clear", "--salt", "y").stdout.strip() == "dropped 0 chunks"
    assert kvdepot(server, "clear", "--salt", "x", "--tenant", "-").stdout.strip() == \
        "dropped 3 chunks"
    refused = kvdepot(server, "quota", "bad name", "--set", "1GiB")
    assert refused.returncode == 2 and "HTTP 400" in refused.stderr
    unreachable = subprocess.run(
        [sys.executable, "-m", "kvdepot.cli", "status", "--admin-url",
         f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60)
    assert unreachable.returncode == 2 and "cannot reach the admin API" in unreachable.stderr


def test_readyz_answers_503_while_the_server_drains(server, engines_at):
    import signal
    import time

    engine = engines_at(server.url)
    engine.fill(seed=3)
    engine.store("s", PROMPT, BLOCKS, 0, 3 * CHUNK)
    # A promised retrieve that never comes keeps the drain waiting for a moment.
    assert engine.lookup("promised", PROMPT) == 3 * CHUNK
    admin = api(server)
    assert admin.call("GET", "/readyz")[0] == 200
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while True:
        status, answer = admin.call("GET", "/readyz")
        if status == 503:
            break
        assert time.monotonic() < deadline, "readyz never said the server drains"
        time.sleep(0.01)
    assert (answer["ready"], answer["reason"]) == (False, "draining")
    health = admin.call("GET", "/healthz")  # alive, not ready
    assert health[0] == 200 and health[1]["status"] == "ok"
    assert admin.status()["draining"] is True
    assert server.proc.wait(30) == 0
