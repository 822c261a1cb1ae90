"""The HTTP admin API and the dashboard (`kvdepot serve --admin-port`, docs/admin.md).

Starlette routes served by uvicorn on a thread of the server process. Handlers never
touch the control thread's state themselves: they hand a function to the loop
(`RouterServer.call_in_loop`) and await its result, so reads and changes happen between
two requests, on the thread that owns them, with no lock added to the hot path. A loop
that does not answer within `LOOP_TIMEOUT` fails liveness (`/healthz`); readiness
(`/readyz`) also fails while a new engine could not be taken (`server/readiness.py`).
The listener is bounded like every HTTP listener of the server (`server/http_bounds.py`).

Who may call what (docs/admin.md, "Authentication"):
- `--insecure`: everyone, everything (as on the ZeroMQ port).
- loopback listener: reads without a credential; changes need an admin bearer.
- beyond loopback (TLS required): probes need any accepted credential's bearer,
  everything else an admin one.

Cache salts are secrets (tenants keep their users' prompts apart with them): only an
admin bearer (or `--insecure`) sees them; other readers of /v1/tenants get each scope's
`salt` as null and a `salt_id` that tells scopes apart without giving the salt away.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import socket
import ssl
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from kvdepot.errors import AddressInUse
from kvdepot.options import Options
from kvdepot.rpc.auth import Identity, ServerAuth
from kvdepot.rpc.connection_guard import descriptor_limit
from kvdepot.rpc.credentials import check_name, is_loopback_host
from kvdepot.rpc.router import RouterServer
from kvdepot.server.depot import Depot
from kvdepot.server.http_bounds import BoundedHttpServer, HttpBounds
from kvdepot.server.prometheus import StatsCollector
from kvdepot.server.readiness import EngineReadiness
from kvdepot.server.status import server_status, tenants

log = logging.getLogger(__name__)

LOOP_TIMEOUT = 5.0
"""Seconds the control loop may take to run an admin request before the API answers
503; the loop answers a lookup in well under a millisecond when healthy."""
MAX_BODY_BYTES = 64 << 10
"""Every request body the API accepts is a small JSON object."""
NO_TENANT = "-"
"""The tenant of the owner and of credentials without one, in URL paths (tenant names
start with a letter or digit, so it is never a real one)."""
EVERY_TENANT = "*"
"""In /v1/quotas/{tenant}: the default quota of every named tenant without one of its own."""
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
STATIC = Path(__file__).with_name("dashboard")

PROBE, READ, ADMIN = "probe", "read", "admin"
HEALTHZ_MEANS = ("liveness: the control loop ran a request from this API within "
                 f"{LOOP_TIMEOUT:g} s; it says nothing of whether a new engine can connect "
                 "(see /readyz)")
READYZ_MEANS = ("readiness: the control loop answers, the server is not draining, enough "
                "descriptors are free for new engines, and the request socket greets a new "
                "connection within a second; a new engine can connect and register now")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


@dataclass
class AdminState:
    """What the handlers reach: filled in as the server comes up."""

    options: Options
    auth: ServerAuth
    started_at: float = field(default_factory=time.monotonic)
    router: RouterServer | None = None
    depot: Depot | None = None
    readiness: EngineReadiness | None = None
    bounds: HttpBounds | None = None
    salt_key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    """Keys `salt_id`: random per server run, so an id cannot be tried against guessed
    salts (they are often short, like "user-42") outside this process."""

    @property
    def open_reads(self) -> bool:
        return is_loopback_host(self.options.admin_host)


# ---- helpers ---------------------------------------------------------------------------------
def _authorize(state: AdminState, request: Request, need: str) -> Identity | None:
    """Raise 401/403 unless the request may do `need`; the caller's identity if it sent one."""
    if not state.auth.enabled:
        return None
    header = request.headers.get("authorization", "")
    identity = None
    if header:
        scheme, _, bearer = header.partition(" ")
        assert state.auth.store is not None
        identity = (state.auth.store.check_bearer(bearer.strip())
                    if scheme.lower() == "bearer" else None)
        if identity is None:
            raise HTTPError(401, "the bearer token is not one of an accepted credential "
                            "(see docs/admin.md)", {"WWW-Authenticate": "Bearer"})
    needs_identity = need == ADMIN or not state.open_reads
    if identity is None and needs_identity:
        raise HTTPError(401, "this endpoint needs an Authorization: Bearer header with a "
                        "credential's admin API token (`kvdepot credentials bearer`, "
                        "docs/admin.md)", {"WWW-Authenticate": "Bearer"})
    if identity is not None and need != PROBE and needs_identity and not identity.is_admin:
        raise HTTPError(403, f"this endpoint needs an admin credential; {identity.name!r} has "
                        f"the role {identity.role!r}")
    return identity


def _shows_salts(state: AdminState, identity: Identity | None) -> bool:
    """Whether this reader may see cache salts: an admin credential, or no authentication
    at all (--insecure makes everyone an admin, as on the ZeroMQ port)."""
    return not state.auth.enabled or (identity is not None and identity.is_admin)


def salt_id(state: AdminState, salt: str) -> str:
    """A stable name of a salt for this server run (HMAC-SHA256 under `salt_key`, 64
    bits): the same salt always gets the same id, and the id says nothing of the salt."""
    return hmac.new(state.salt_key, salt.encode(), hashlib.sha256).hexdigest()[:16]


def _scopes(state: AdminState, scopes: list[dict[str, Any]], shown: bool
            ) -> list[dict[str, Any]]:
    return [{**scope, "salt": scope["salt"] if shown else None,
             "salt_id": salt_id(state, scope["salt"])} for scope in scopes]


def _hide_salt(scope: dict[str, Any]) -> dict[str, Any]:
    """A clear's scope as the log shows it: logs reach more readers than the API does."""
    return {**scope, "cache_salt": "(hidden)"} if "cache_salt" in scope else scope


async def _in_loop(state: AdminState, fn: Callable[[Depot], Any]) -> Any:
    """Run `fn(depot)` on the control thread and return what it returned."""
    router, depot = state.router, state.depot
    if router is None or depot is None:
        raise HTTPError(503, "the server is starting")
    future: Future[Any] = router.call_in_loop(lambda: fn(depot))
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), LOOP_TIMEOUT)
    except TimeoutError:
        future.cancel()
        raise HTTPError(503, f"the control loop did not answer within {LOOP_TIMEOUT:g} s") from None
    except asyncio.CancelledError:
        if future.cancelled():
            raise HTTPError(503, "the server is stopping") from None
        raise


async def _json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object (an empty body is `{}`), at most MAX_BODY_BYTES."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
        raise HTTPError(413, f"request bodies are at most {MAX_BODY_BYTES} bytes")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_BODY_BYTES:
            raise HTTPError(413, f"request bodies are at most {MAX_BODY_BYTES} bytes")
    if not body.strip():
        return {}
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise HTTPError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise HTTPError(400, "the body must be a JSON object")
    return value


def _fields(body: dict[str, Any], allowed: dict[str, tuple[type, ...]]) -> dict[str, Any]:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise HTTPError(400, f"unknown fields {unknown}; allowed: {sorted(allowed)}")
    for name, value in body.items():
        if not isinstance(value, allowed[name]) or (isinstance(value, bool) and bool not in \
                allowed[name]):
            kinds = " or ".join("null" if t is type(None) else t.__name__ for t in allowed[name])
            raise HTTPError(400, f"{name} must be {kinds}, got {json.dumps(value)[:80]}")
    return body


def _tenant(path_value: str) -> str:
    if path_value == NO_TENANT:
        return ""
    if path_value == EVERY_TENANT:
        return EVERY_TENANT
    try:
        return check_name("tenant", path_value)
    except ValueError as exc:
        raise HTTPError(400, f"{exc} (or {NO_TENANT!r}: no tenant, {EVERY_TENANT!r}: the "
                        "default of every tenant)") from None


# ---- endpoints -----------------------------------------------------------------------------
def build_app(state: AdminState) -> Starlette:
    def endpoint(need: str, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            try:
                request.state.identity = _authorize(state, request, need)
                result = await handler(request)
            except HTTPError as exc:
                return JSONResponse({"error": str(exc)}, exc.status, headers=exc.headers)
            return result if isinstance(result, Response) else JSONResponse(result)

        return run

    async def healthz(_: Request) -> Any:
        if state.depot is None:
            return {"status": "starting", "means": HEALTHZ_MEANS}
        try:
            await _in_loop(state, lambda _: None)
        except HTTPError as exc:
            return JSONResponse({"error": str(exc), "means": HEALTHZ_MEANS}, exc.status)
        return {"status": "ok", "means": HEALTHZ_MEANS}

    async def readyz(_: Request) -> Any:
        try:
            draining = await _in_loop(state, lambda depot: depot.draining)
        except HTTPError as exc:
            return JSONResponse({"ready": False, "reason": str(exc), "means": READYZ_MEANS},
                                503)
        reason = "draining" if draining else None
        if reason is None and state.readiness is not None:
            reason = await state.readiness.reason_not_ready()
        if reason is not None:
            return JSONResponse({"ready": False, "reason": reason, "means": READYZ_MEANS}, 503)
        return {"ready": True, "means": READYZ_MEANS}

    async def status(_: Request) -> Any:
        return await _in_loop(state, lambda depot: server_status(depot, state.started_at))

    async def list_tenants(request: Request) -> Any:
        shown = _shows_salts(state, request.state.identity)
        found = await _in_loop(state, lambda depot: (tenants(depot), depot.tenants.scope_usage()))
        return {"tenants": found[0], "scopes": _scopes(state, found[1], shown),
                "salts_shown": shown}

    async def list_quotas(_: Request) -> Any:
        return {"quotas": await _in_loop(state, lambda depot: depot.tenants.quotas())}

    async def get_quota(request: Request) -> Any:
        tenant = _tenant(request.path_params["tenant"])
        quota = await _in_loop(state, lambda depot: depot.tenants.quotas().get(tenant))
        return {"tenant": tenant, "cpu_bytes": quota}

    async def put_quota(request: Request) -> Any:
        tenant = _tenant(request.path_params["tenant"])
        body = _fields(await _json_body(request), {"cpu_bytes": (int, type(None))})
        if "cpu_bytes" not in body:
            raise HTTPError(400, "give cpu_bytes: a byte count, or null to remove the quota")
        cpu_bytes = body["cpu_bytes"]
        if cpu_bytes is not None and cpu_bytes < 0:
            raise HTTPError(400, f"cpu_bytes must be >= 0, got {cpu_bytes}")
        try:
            await _in_loop(state, lambda depot: depot.tenants.set_quota(tenant, cpu_bytes))
        except ValueError as exc:  # the depot's word on what may have a quota
            raise HTTPError(400, str(exc)) from None
        log.info("admin API: quota of tenant %r set to %s", tenant or NO_TENANT, cpu_bytes)
        return {"tenant": tenant, "cpu_bytes": cpu_bytes}

    async def clear(request: Request) -> Any:
        scope = _fields(await _json_body(request),
                        {"model": (str,), "tenant": (str,), "cache_salt": (str,)})
        dropped = await _in_loop(state, lambda depot: depot.tenants.clear(**scope))
        log.info("admin API: cleared %d chunks (scope %s)", dropped, _hide_salt(scope) or "all")
        return {"dropped": dropped, "scope": scope}

    async def log_level(request: Request) -> Any:
        body = _fields(await _json_body(request), {"level": (str,), "logger": (str,)})
        level = str(body.get("level", "")).upper()
        if level not in LOG_LEVELS:
            raise HTTPError(400, f"level must be one of {list(LOG_LEVELS)}")
        name = body.get("logger", "")
        if name and not (name == "kvdepot" or name.startswith("kvdepot.")):
            raise HTTPError(400, "logger must be kvdepot's (\"kvdepot\" or \"kvdepot.*\"), or "
                            "empty for the root logger")
        logging.getLogger(name or None).setLevel(level)
        log.warning("admin API: log level of %s set to %s", name or "the root logger", level)
        return {"logger": name, "level": level}

    async def metrics(_: Request) -> Any:
        depot = state.depot
        if depot is None:
            raise HTTPError(503, "the server is starting")
        registry = CollectorRegistry()
        registry.register(StatsCollector(depot.metrics.snapshot))
        # Gauges read the tiers under their own locks (as on --metrics-port), off the
        # event loop: counting locked chunks walks the CPU tier.
        body = await run_in_threadpool(generate_latest, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def openapi(_: Request) -> Any:
        return FileResponse(STATIC / "openapi.json", media_type="application/json")

    async def dashboard(_: Request) -> Any:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    routes = [
        # The dashboard's files hold no figures: they are served to everyone, and the
        # page asks for a bearer when the API wants one.
        Route("/", dashboard, methods=["GET"]),
        Mount("/dashboard", StaticFiles(directory=STATIC), name="dashboard"),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/healthz", endpoint(PROBE, healthz), methods=["GET"]),
        Route("/readyz", endpoint(PROBE, readyz), methods=["GET"]),
        Route("/metrics", endpoint(READ, metrics), methods=["GET"]),
        Route("/v1/status", endpoint(READ, status), methods=["GET"]),
        Route("/v1/tenants", endpoint(READ, list_tenants), methods=["GET"]),
        Route("/v1/quotas", endpoint(READ, list_quotas), methods=["GET"]),
        Route("/v1/quotas/{tenant}", endpoint(READ, get_quota), methods=["GET"]),
        Route("/v1/quotas/{tenant}", endpoint(ADMIN, put_quota), methods=["PUT"]),
        Route("/v1/clear", endpoint(ADMIN, clear), methods=["POST"]),
        Route("/v1/log-level", endpoint(ADMIN, log_level), methods=["PUT"]),
    ]
    return Starlette(routes=routes)


# ---- the server thread -------------------------------------------------------------------
class AdminServer:
    """Binds the admin port at once (a taken port fails `kvdepot serve` before anything
    else) and serves it from a thread until `stop()`."""

    def __init__(self, state: AdminState) -> None:
        options = state.options
        host, port = options.admin_host, options.admin_port
        assert port is not None
        if state.auth.enabled and not is_loopback_host(host) and not options.admin_tls_cert:
            raise ValueError(f"refusing to serve the admin API on {host} (beyond loopback) "
                             "without TLS: give --admin-tls-cert and --admin-tls-key, or use "
                             "--insecure")
        if bool(options.admin_tls_cert) != bool(options.admin_tls_key):
            raise ValueError("--admin-tls-cert and --admin-tls-key go together")
        tls = None
        if options.admin_tls_cert:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:  # here: a bad certificate stops `kvdepot serve` with a message
                tls.load_cert_chain(options.admin_tls_cert, options.admin_tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"cannot load --admin-tls-cert/--admin-tls-key: {exc}"
                                 ) from None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._socket = socket.create_server((host.strip("[]"), port), family=family)
        except OSError as exc:
            raise AddressInUse(f"cannot serve the admin API on {host}:{port}: {exc}") from None
        scheme = "https" if options.admin_tls_cert else "http"
        self.url = f"{scheme}://{host}:{self._socket.getsockname()[1]}"
        bounds = state.bounds or HttpBounds(descriptor_limit())
        self._server = BoundedHttpServer(build_app(state), self._socket, bounds, "admin-api",
                                         tls)

    def stop(self) -> None:
        self._server.stop()
