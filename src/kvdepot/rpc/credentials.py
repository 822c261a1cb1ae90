"""Credentials: what a client presents to a kvdepot server, and where clients find it.

A credential is a small JSON file (format in docs/security.md) holding a name, a random
token and, where CURVE is available, a client keypair and the server's public key. The
server writes its owner's credential into its state directory (0700) under a name
derived from its URL, so processes of the same user find it from the URL alone; a
process of another user cannot read it. `KVDEPOT_CREDENTIALS` (or the connector's
`kvdepot.credentials` key) names a file explicitly, e.g. a tenant credential.

On loopback and ipc:// the mechanism is PLAIN (the token, no per-message crypto: another
local user cannot sniff loopback); beyond loopback it is CURVE. A PLAIN token is never
sent to an address that is not loopback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import zmq

from kvdepot.errors import AuthenticationFailed

STATE_DIR_ENV = "KVDEPOT_STATE_DIR"
CREDENTIALS_ENV = "KVDEPOT_CREDENTIALS"
FORMAT = "kvdepot-credential/1"
OWNER = "owner"
ROLES = ("admin", "engine")
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""Credential and tenant names: they appear in logs and in key scopes, so nothing odd."""

PLAIN, CURVE, NULL = "plain", "curve", "null"
ADMIN_API_DOMAIN = b"kvdepot/admin-api-bearer/v1"


def check_name(kind: str, name: str) -> str:
    if not NAME_RULE.fullmatch(name):
        raise ValueError(f"{kind} {name[:80]!r} is not allowed: use 1-64 letters, digits, '.', "
                         "'_' or '-', starting with a letter or digit")
    return name


@dataclass(frozen=True)
class Credential:
    name: str
    token: str
    role: str = "engine"
    tenant: str = ""
    curve_public: str = ""
    curve_secret: str = ""
    server_public: str = ""
    mechanism: str = ""
    """What the server speaks (its owner file says so); empty: PLAIN on loopback and
    ipc://, CURVE elsewhere."""
    server_uid: str = ""
    """The uid the server runs as: PLAIN does not authenticate the server, so the token
    is only sent to a loopback listener this uid owns (not to one squatting the port)."""
    source: str = dataclasses.field(default="", compare=False)
    """Where it was read from, for error messages."""

    def to_json(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name != "source" and getattr(self, f.name)}
        return json.dumps({"format": FORMAT, **fields}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> Credential:
        data = json.loads(text)
        if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
            raise ValueError(f"{source} is not a kvdepot credential (format {FORMAT!r})")
        known = {f.name for f in dataclasses.fields(cls)} - {"source"}
        unknown = set(data) - known
        if unknown or not isinstance(data.get("name"), str) or not isinstance(
                data.get("token"), str):
            raise ValueError(f"{source}: a credential needs 'name' and 'token' and nothing "
                             f"but {sorted(known)} (unknown: {sorted(unknown)})")
        return cls(**{k: str(v) for k, v in data.items()}, source=source)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Credential:
        with open(path) as f:
            return cls.from_json(f.read(), str(path))

    def admin_bearer(self) -> str:
        """The bearer token this credential presents to the HTTP admin API."""
        return admin_bearer(self.name, token_digest(self.token))

    def mechanism_for(self, url: str) -> str:
        return self.mechanism or (PLAIN if is_loopback_url(url) else CURVE)

    def apply(self, sock: zmq.Socket, url: str) -> None:
        """Set the socket options that present this credential to the server at `url`."""
        mechanism = self.mechanism_for(url)
        if mechanism == PLAIN:
            if not is_loopback_url(url):
                raise AuthenticationFailed(
                    f"credential {self.name!r} ({self.source}) is a PLAIN token, which is only "
                    f"sent to loopback or ipc:// servers, not to {url}")
            self._check_listener(url)
            sock.plain_username = self.name.encode()
            sock.plain_password = self.token.encode()
        elif mechanism == CURVE:
            if not (self.curve_public and self.curve_secret and self.server_public):
                raise AuthenticationFailed(
                    f"credential {self.name!r} ({self.source}) has no CURVE keys, which the "
                    f"server at {url} needs (it listens beyond loopback)")
            sock.curve_serverkey = self.server_public.encode()
            sock.curve_publickey = self.curve_public.encode()
            sock.curve_secretkey = self.curve_secret.encode()


    def _check_listener(self, url: str) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "tcp" or not self.server_uid:
            return
        owner = listener_uid(parsed.port or 5555)
        if owner is not None and str(owner) != self.server_uid:
            raise AuthenticationFailed(
                f"the process listening on {url} runs as uid {owner}, but the kvdepot server of "
                f"credential {self.name!r} runs as uid {self.server_uid}: not sending it the token")


def listener_uid(port: int) -> int | None:
    """The uid owning the TCP socket listening on `port` here (None if none is visible)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return int(fields[7])
    return None


def new_credential(name: str, role: str, tenant: str = "", server_public: str = "",
                   mechanism: str = "") -> Credential:
    check_name("credential name", name)
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if tenant:
        check_name("tenant", tenant)
    public = secret = ""
    if zmq.has("curve"):
        public_b, secret_b = zmq.curve_keypair()
        public, secret = public_b.decode(), secret_b.decode()
    return Credential(name=name, token=secrets.token_urlsafe(32), role=role, tenant=tenant,
                      curve_public=public, curve_secret=secret, server_public=server_public,
                      mechanism=mechanism, server_uid=str(os.getuid()))


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def admin_bearer(name: str, digest: str) -> str:
    """`NAME.MAC`: an HMAC keyed with the token's SHA-256, which the server keeps for every
    credential, so it checks bearers without the token; a bearer seen on the wire does not
    give the token (the ZeroMQ secret) away."""
    mac = hmac.new(digest.encode(), ADMIN_API_DOMAIN, hashlib.sha256).hexdigest()
    return f"{name}.{mac}"


# ---- where credentials live ------------------------------------------------------------
def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_loopback_url(url: str) -> bool:
    parsed = urlparse(url)
    return parsed.scheme == "ipc" or (parsed.scheme == "tcp" and
                                      is_loopback_host(parsed.hostname or ""))


def default_state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV) or Path.home() / ".kvdepot")


def server_file(state_dir: Path, url: str) -> Path:
    """The owner credential of the server at `url`: by port for tcp (whatever host name
    a client uses for it), by a hash of the path for ipc."""
    parsed = urlparse(url)
    if parsed.scheme == "ipc":
        slug = "ipc-" + hashlib.sha256(url[len("ipc://"):].encode()).hexdigest()[:16]
    else:
        slug = f"tcp-{parsed.port or 5555}"
    return state_dir / "servers" / f"{slug}.json"


def find_credential(url: str, path: str | None = None) -> Credential | None:
    """The credential to present to `url`: the file `path` names, else `$KVDEPOT_CREDENTIALS`,
    else the owner file a server of this user wrote for that URL (None if there is none
    this process may read)."""
    explicit = path or os.environ.get(CREDENTIALS_ENV)
    if explicit:
        try:
            return Credential.read(explicit)
        except (OSError, ValueError) as exc:
            raise AuthenticationFailed(f"cannot read the kvdepot credential {explicit}: "
                                       f"{exc}") from None
    candidate = server_file(default_state_dir(), url)
    try:
        credential = Credential.read(candidate)
    except (OSError, ValueError):
        return None
    if credential.mechanism_for(url) == PLAIN and not is_loopback_url(url):
        return None  # a local server's token, never sent elsewhere
    return credential


def describe_search(url: str, path: str | None = None) -> str:
    """Where `find_credential` looked, for the error a client without one reports."""
    explicit = path or os.environ.get(CREDENTIALS_ENV)
    if explicit:
        return f"the credential file {explicit}"
    return (f"{server_file(default_state_dir(), url)} (written by a server of the same user; "
            f"other users and containers set {CREDENTIALS_ENV} or the connector's "
            "kvdepot.credentials to a credential file, see docs/security.md)")


# ---- private files -------------------------------------------------------------------------
def ensure_private_dir(path: Path) -> Path:
    """Create `path` (mode 0700) or check an existing one is ours and closed to others."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise ValueError(f"{path} belongs to uid {info.st_uid}, not to this user "
                         f"({os.getuid()}); choose another --state-dir")
    if stat.S_IMODE(info.st_mode) & 0o077:
        path.chmod(0o700)
    return path


def write_private_file(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, readable by this user only (0600)."""
    ensure_private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
