"""Credentials: what a client presents to a kvdepot server, and where clients find it.

A credential is a small JSON file (format in docs/security.md) holding a name, a random
token, a client keypair and the server's public key. The server writes its owner's
credential into its state directory (0700) under a name derived from its URL, so
processes of the same user find it from the URL alone; a process of another user cannot
read it. `KVDEPOT_CREDENTIALS` (or the connector's `kvdepot.credentials` key) names a file
explicitly, e.g. a tenant credential.

The mechanism is CURVE everywhere, loopback and ipc:// included: the client pins the
server's public key, so on every connection and every reconnection libzmq proves the
server's identity before anything is sent. A process that took the port of a dead server
(another user's, or ours) completes no handshake and receives nothing: no token, no
request. PLAIN, which authenticated only the client and sent the token in the clear to
whoever listened, is refused with a clear error.
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
import socket
import stat
import sys
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
    """What the server speaks (its owner file says so): empty or "curve"; "null" for a
    server run with --insecure. "plain" (older servers) is refused."""
    server_uid: str = ""
    """The uid the server runs as. The HTTP admin client sends this credential's bearer
    over plain HTTP only to a loopback connection whose server end this uid owns."""
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

    @property
    def effective_mechanism(self) -> str:
        return self.mechanism or CURVE

    @property
    def sends_secrets(self) -> bool:
        """Whether the token may leave this process at all (to the handover socket, as an
        admin API bearer). A credential of an --insecure server never sends it: nothing
        proves such a server's identity, and the server checks no token anyway."""
        return self.effective_mechanism != NULL

    def check_usable(self, url: str) -> None:
        """Raise AuthenticationFailed if this credential cannot prove the server at `url`
        (called before any socket or thread exists, so the caller gets the error)."""
        mechanism = self.effective_mechanism
        if mechanism == PLAIN:
            raise AuthenticationFailed(
                f"credential {self.name!r} ({self.source}) is marked for PLAIN, which kvdepot "
                f"no longer speaks: PLAIN does not prove the server's identity, so a process "
                f"that took the port of a stopped server would receive the token. Restart the "
                f"server at {url} once (it rewrites its owner credential for CURVE) or ask its "
                "operator for a new credential (`kvdepot credentials add`)")
        if mechanism == CURVE and not (self.curve_public and self.curve_secret
                                       and self.server_public):
            raise AuthenticationFailed(
                f"credential {self.name!r} ({self.source}) lacks CURVE keys (curve_public, "
                f"curve_secret and the server's server_public), which the server at {url} "
                "needs to prove its identity; ask its operator for a new credential")
        if mechanism not in (CURVE, NULL):
            raise AuthenticationFailed(f"credential {self.name!r} ({self.source}) names an "
                                       f"unknown mechanism {mechanism!r}")

    def apply(self, sock: zmq.Socket, url: str) -> None:
        """Set the socket options that present this credential to the server at `url`
        and pin that server's public key (libzmq checks it on every reconnection)."""
        self.check_usable(url)
        if self.effective_mechanism == CURVE:
            sock.curve_serverkey = self.server_public.encode()
            sock.curve_publickey = self.curve_public.encode()
            sock.curve_secretkey = self.curve_secret.encode()


def _proc_net_address(host: str, port: int) -> str:
    """`host:port` as /proc/net/tcp{,6} prints it: the address as 32-bit words in host byte
    order, each in hexadecimal, then the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    raw = socket.inet_pton(family, host)
    words = "".join(f"{int.from_bytes(raw[i:i + 4], sys.byteorder):08X}"
                    for i in range(0, len(raw), 4))
    return f"{words}:{port:04X}"


def tcp_peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the other end of the connected loopback TCP socket `sock`, read from
    /proc/net/tcp{,6} by this connection's own 4-tuple (the kernel gives an accepted
    socket the uid of its listener); None if the kernel does not show it here."""
    local, peer = sock.getsockname()[:2], sock.getpeername()[:2]
    # The server's side of this connection: its local address is our peer, its remote ours.
    wanted = (_proc_net_address(*peer), _proc_net_address(*local))
    table = "/proc/net/tcp6" if sock.family == socket.AF_INET6 else "/proc/net/tcp"
    try:
        with open(table) as f:
            lines = f.readlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if (fields[1], fields[2]) == wanted:
            return int(fields[7])
    return None


def new_credential(name: str, role: str, tenant: str = "", server_public: str = ""
                   ) -> Credential:
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
                      server_uid=str(os.getuid()))


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
        return Credential.read(candidate)
    except (OSError, ValueError):
        return None


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
