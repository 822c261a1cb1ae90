"""A client of the HTTP admin API (docs/admin.md): what `kvdepot status`, `top`, `clear`
and `quota` call. The standard library's HTTP client: a few JSON calls need nothing more.

The bearer is a secret: over HTTPS the certificate proves the server; over plain HTTP
(the loopback default) nothing does, and a process of another user that took the port
of a stopped server would receive it. So before a request carrying the bearer is sent,
the client looks up the server's end of this very TCP connection in /proc/net/tcp{,6}
and sends only if the uid the credential names (`server_uid`) owns it; plain HTTP
beyond loopback gets no bearer at all.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvdepot.errors import KVDepotError
from kvdepot.rpc.credentials import Credential, find_credential, is_loopback_host, tcp_peer_uid

ADMIN_URL_ENV = "KVDEPOT_ADMIN_URL"
ADMIN_CA_ENV = "KVDEPOT_ADMIN_CA"
NO_TENANT = "-"
"""The owner's (tenant-less) scope in the API's URL paths."""


class AdminAPIError(KVDepotError):
    """The admin API answered with an error, or could not be reached."""


class AdminAPI:
    def __init__(self, admin_url: str | None = None, *, url: str = "tcp://127.0.0.1:5555",
                 credentials: str | None = None, ca_file: str | None = None,
                 timeout: float = 10.0) -> None:
        """`admin_url`: http(s)://HOST:PORT of `--admin-port` (default $KVDEPOT_ADMIN_URL).
        The bearer comes from `credentials` (else $KVDEPOT_CREDENTIALS, else the owner
        credential of the server at `url`); none is sent when there is none (reads on a
        loopback listener need none). `ca_file`: the CA of an HTTPS listener's certificate
        (default $KVDEPOT_ADMIN_CA, else the system's)."""
        admin_url = admin_url or os.environ.get(ADMIN_URL_ENV)
        if not admin_url:
            raise AdminAPIError("no admin API address: give --admin-url (the server's "
                                f"--admin-port) or set {ADMIN_URL_ENV}")
        self.base = admin_url.rstrip("/")
        credential = find_credential(url, credentials)
        sends = credential is not None and credential.sends_secrets
        self._bearer = credential.admin_bearer() if credential is not None and sends else None
        ca_file = ca_file or os.environ.get(ADMIN_CA_ENV)
        self._ssl = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self.timeout = timeout
        handlers: list[urllib.request.BaseHandler] = [
            urllib.request.HTTPSHandler(context=self._ssl), _NoRedirects()]
        if self._bearer is not None:
            assert credential is not None
            handlers.append(_OwnerCheckedHTTPHandler(credential))
        self._opener = urllib.request.build_opener(*handlers)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None
             ) -> tuple[int, Any]:
        """(status, decoded JSON) for any answer; AdminAPIError if none came."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self._bearer:
            request.add_header("Authorization", f"Bearer {self._bearer}")
        try:
            with self._opener.open(request, timeout=self.timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as exc:
            payload = exc.read()
            try:
                return exc.code, json.loads(payload)
            except ValueError:
                return exc.code, {"error": payload.decode(errors="replace")[:500]}
        except (urllib.error.URLError, OSError) as exc:
            raise AdminAPIError(f"cannot reach the admin API at {self.base}: "
                                f"{getattr(exc, 'reason', exc)}") from None

    def _ok(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        status, value = self.call(method, path, body)
        if status != 200:
            message = value.get("error", value) if isinstance(value, dict) else value
            raise AdminAPIError(f"{method} {path}: HTTP {status}: {message}")
        return value

    def status(self) -> dict[str, Any]:
        return self._ok("GET", "/v1/status")

    def tenants(self) -> dict[str, Any]:
        return self._ok("GET", "/v1/tenants")["tenants"]

    def quotas(self) -> dict[str, int]:
        return self._ok("GET", "/v1/quotas")["quotas"]

    def quota(self, tenant: str) -> int | None:
        return self._ok("GET", _quota_path(tenant))["cpu_bytes"]

    def set_quota(self, tenant: str, cpu_bytes: int | None) -> None:
        self._ok("PUT", _quota_path(tenant), {"cpu_bytes": cpu_bytes})

    def clear(self, model: str | None = None, tenant: str | None = None,
              cache_salt: str | None = None) -> int:
        scope = {k: v for k, v in (("model", model), ("tenant", tenant),
                                   ("cache_salt", cache_salt)) if v is not None}
        return self._ok("POST", "/v1/clear", scope)["dropped"]

    def set_log_level(self, level: str, logger: str = "") -> None:
        self._ok("PUT", "/v1/log-level", {"level": level, "logger": logger})


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """The API never redirects; following one would carry the bearer elsewhere."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class _OwnerCheckedConnection(http.client.HTTPConnection):
    """Plain HTTP that, once connected and before sending a byte, checks who holds the
    server's end: a loopback socket of the credential's server uid, or nothing is sent."""

    def __init__(self, host: str, *, credential: Credential, **kwargs: Any) -> None:
        super().__init__(host, **kwargs)
        self._credential = credential

    def connect(self) -> None:
        super().connect()
        where = f"{self.host}:{self.port}"
        reason = None
        peer_host = self.sock.getpeername()[0]
        if not is_loopback_host(peer_host):
            reason = "it is beyond loopback and plain HTTP proves nothing there (use HTTPS)"
        elif not self._credential.server_uid:
            reason = (f"credential {self._credential.name!r} names no server_uid to check "
                      "the listener against")
        else:
            owner = tcp_peer_uid(self.sock)
            if owner is None or str(owner) != self._credential.server_uid:
                reason = (f"its listener runs as uid {owner}, but the kvdepot server of "
                          f"credential {self._credential.name!r} runs as uid "
                          f"{self._credential.server_uid}")
        if reason is not None:
            self.close()
            raise AdminAPIError(f"not sending the admin bearer to {where}: {reason}")


class _OwnerCheckedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, credential: Credential) -> None:
        super().__init__()
        self._credential = credential

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_OwnerCheckedConnection, req, credential=self._credential)


def _quota_path(tenant: str) -> str:
    return "/v1/quotas/" + urllib.parse.quote(tenant or NO_TENANT, safe="")
