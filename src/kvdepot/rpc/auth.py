"""The server's side of authentication: which credentials it accepts, the ZAP handler
that checks every connection's handshake, and the identity each message carries.

State directory (default ~/.kvdepot, 0700, files 0600):
  server-curve.json        the server's CURVE keypair (shared by this user's servers)
  servers/tcp-PORT.json    the owner credential of the server on PORT (role admin)
  credentials/NAME.json    credentials an operator added: role, tenant, the token's
                           SHA-256 and the CURVE public key, never a secret

The server speaks CURVE (loopback included), so every client has proved, by completing
the handshake, that it knows the server's public key and that the server holds the
matching secret key: nothing is ever sent to a process that merely took the port.

ZeroMQ asks the ZAP handler (RFC 27) about each new connection; the handler answers
with the credential's name, its version (derived from its token) and a session number
unique to this handshake as the connection's User-Id, which every message of the
connection then carries and the router maps back to an `Identity`. A credential removed
from the directory stops working at once, on its open connections too, even when another
credential is added under its name. The session number is what binds a registration to
its connection: the ROUTER's routing id can be chosen by the client (`ZMQ_ROUTING_ID`,
any bytes, a leading zero byte included), the session number cannot.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils.z85 import encode as z85_encode

from kvdepot.log_limiter import LogLimiter
from kvdepot.rpc.credentials import (
    CURVE,
    NULL,
    OWNER,
    Credential,
    admin_bearer,
    check_name,
    ensure_private_dir,
    new_credential,
    server_file,
    token_digest,
    write_private_file,
)

log = logging.getLogger(__name__)
refusals_log = LogLimiter(log)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"kvdepot"
EVENTS_ZAP_DOMAIN = b"kvdepot-events"
"""The KV event sockets' domain: only admin credentials subscribe (events name every
tenant's chunks)."""
_RELOAD_INTERVAL = 1.0
_USER_ID_SEPARATOR = "/"
"""Between a credential's name (which never holds one) and its version in a User-Id."""
_VERSION_CHARS = 16


@dataclass(frozen=True, slots=True)
class Identity:
    """What the server knows about the sender of a message."""

    name: str
    role: str
    tenant: str = ""

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


ANONYMOUS = Identity("anonymous", "admin")
"""Everyone, when the server runs with --insecure."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: the connection (ROUTER routing id) and its credential."""

    connection: bytes
    identity: Identity


# ---- files ---------------------------------------------------------------------------------
def server_keypair(state_dir: Path) -> tuple[str, str]:
    """The servers' CURVE keypair (z85), created on first use."""
    path = state_dir / "server-curve.json"
    try:
        data = json.loads(path.read_text())
        return data["public"], data["secret"]
    except (OSError, ValueError, KeyError):
        public, secret = (k.decode() for k in zmq.curve_keypair())
        write_private_file(path, json.dumps({"public": public, "secret": secret}) + "\n")
        return public, secret


def write_owner_credential(state_dir: Path, url: str, mechanism: str,
                           server_public: str) -> Credential:
    """Write (or refresh) the owner credential of the server at `url`.

    The token and keys of an earlier CURVE run are kept, so engines that outlive the
    server (they hold the credential in memory) reconnect to its restart by themselves:
    under CURVE the client's secret key never travels, and the token only goes to a
    handover socket of the authenticated server's process (and the bearer to a loopback
    admin port of its uid), so a process that squatted the port in between got neither.
    A credential of an earlier PLAIN (or --insecure) run is replaced: its token travelled
    in the clear to whatever answered on the port."""
    path = server_file(state_dir, url)
    try:
        old = Credential.read(path)
    except (OSError, ValueError):
        old = None
    fresh = new_credential(OWNER, "admin")
    keep = (old is not None and old.name == OWNER and old.curve_public and old.curve_secret
            and (old.mechanism == mechanism or mechanism == NULL)
            and (mechanism == NULL or old.server_public == server_public))
    base = old if keep and old is not None else fresh
    owner = Credential(name=OWNER, token=base.token, role="admin",
                       curve_public=base.curve_public, curve_secret=base.curve_secret,
                       server_public=server_public if mechanism == CURVE else "",
                       mechanism=mechanism, server_uid=str(os.getuid()), source=str(path))
    write_private_file(path, owner.to_json())
    return owner


def add_credential(state_dir: Path, name: str, role: str, tenant: str) -> Credential:
    """Accept a new credential on every server of `state_dir`; returns the whole credential
    (the only copy of its secrets) for the operator to hand to its user."""
    if name == OWNER:
        raise ValueError(f"{OWNER!r} is the server's own credential")
    path = state_dir / "credentials" / f"{check_name('credential name', name)}.json"
    if path.exists():
        raise ValueError(f"a credential named {name!r} exists already ({path}); remove it first")
    if not zmq.has("curve"):
        raise ValueError("this libzmq lacks CURVE, which every kvdepot credential needs")
    server_public = server_keypair(state_dir)[0]
    credential = new_credential(name, role, tenant, server_public)
    entry = {"name": name, "role": role, "tenant": tenant,
             "token_sha256": token_digest(credential.token),
             "curve_public": credential.curve_public}
    write_private_file(path, json.dumps(entry, indent=2) + "\n")
    return credential


def remove_credential(state_dir: Path, name: str) -> bool:
    path = state_dir / "credentials" / f"{check_name('credential name', name)}.json"
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def read_added_credentials(state_dir: Path) -> list[dict[str, str]]:
    entries = []
    for path in sorted((state_dir / "credentials").glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            check_name("credential name", entry["name"])
            if entry["role"] not in ("admin", "engine"):
                raise ValueError(f"unknown role {entry['role']!r}")
            if not isinstance(entry["tenant"], str):
                raise ValueError("tenant must be a string")
            if entry["tenant"]:
                check_name("tenant", entry["tenant"])
            # Every field the store reads is checked here, so one bad file is skipped
            # instead of failing the threads that authenticate.
            if not isinstance(entry["token_sha256"], str) or len(entry["token_sha256"]) != 64:
                raise ValueError("token_sha256 must be 64 hexadecimal characters")
            if not isinstance(entry.get("curve_public", ""), str):
                raise ValueError("curve_public must be a string")
            entries.append(entry)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("ignored the credential file %s: %s", path, exc)
    return entries


# ---- what the server accepts -------------------------------------------------------------
def _entry(identity: Identity, digest: str) -> tuple[Identity, str, str]:
    """A store entry; its version is derived from the token's digest (not the digest
    itself: User-Ids may be logged)."""
    return identity, digest, hashlib.sha256(digest.encode()).hexdigest()[:_VERSION_CHARS]


class CredentialStore:
    """The owner credential and the added ones, re-read when the directory changes."""

    def __init__(self, state_dir: Path, owner: Credential) -> None:
        self._dir = ensure_private_dir(state_dir / "credentials")
        self._owner = owner
        self.owner_path = owner.source
        self._lock = threading.Lock()
        self._stamp: int | None = None
        self._next_check = 0.0
        self._by_name: dict[str, tuple[Identity, str, str]] = {}
        """name -> (identity, token digest, version: which credential of that name)"""
        self._by_curve_key: dict[str, Identity] = {}
        self._sessions = itertools.count(1)
        """Numbers the handshakes: every connection's User-Id ends in a number of its own."""
        self.reload(now=True)

    def reload(self, now: bool = False) -> None:
        """Pick up added and removed credentials: the directory is looked at when `now`
        (a handshake), else at most once a second, and read again when it changed."""
        clock = time.monotonic()
        if not now and clock < self._next_check:
            return
        with self._lock:
            self._next_check = clock + _RELOAD_INTERVAL
            try:
                stamp = self._dir.stat().st_mtime_ns
            except OSError:
                stamp = None
            if stamp == self._stamp and self._by_name:
                return
            self._stamp = stamp
            owner = Identity(OWNER, "admin")
            by_name = {OWNER: _entry(owner, token_digest(self._owner.token))}
            by_key = {self._owner.curve_public: owner} if self._owner.curve_public else {}
            for entry in read_added_credentials(self._dir.parent):
                identity = Identity(entry["name"], entry["role"], entry["tenant"])
                by_name[identity.name] = _entry(identity, entry["token_sha256"])
                if entry.get("curve_public"):
                    by_key[entry["curve_public"]] = identity
            self._by_name, self._by_curve_key = by_name, by_key

    def user_id(self, identity: Identity) -> str:
        """What ZAP gives a connection as its User-Id: the credential's name, which
        credential of that name it proved (so that removing a credential and adding
        another under the same name revokes the old one's connections too), and a session
        number no other handshake of this server gets."""
        entry = self._by_name.get(identity.name)
        version = entry[2] if entry else ""
        session = next(self._sessions)  # atomic under the GIL
        return _USER_ID_SEPARATOR.join((identity.name, version, str(session)))

    def identity(self, user_id: str) -> Identity | None:
        """The credential a connection's User-Id names, if it is still accepted."""
        name, _, rest = user_id.partition(_USER_ID_SEPARATOR)
        version = rest.partition(_USER_ID_SEPARATOR)[0]
        entry = self._by_name.get(name)
        if entry is None or entry[2] != version:
            return None
        return entry[0]

    def caller(self, routing_id: bytes, user_id: str) -> Caller | None:
        """Who sent a message: its connection is named by the routing id and the
        handshake's session number, which the client cannot choose; None when the
        credential was revoked since the handshake."""
        identity = self.identity(user_id)
        if identity is None:
            return None
        session = user_id.rpartition(_USER_ID_SEPARATOR)[2]
        return Caller(routing_id + b"\0" + session.encode(), identity)

    def check_token(self, name: str, token: str) -> Identity | None:
        entry = self._by_name.get(name)
        if entry is None or not hmac.compare_digest(token_digest(token), entry[1]):
            return None
        return entry[0]

    def check_bearer(self, bearer: str) -> Identity | None:
        """The identity of an admin API bearer (`Credential.admin_bearer`), None if it is
        not one of a credential accepted now (the directory is looked at again, as for a
        handshake: a credential just added works, one just removed does not)."""
        self.reload(now=True)
        name = bearer.rpartition(".")[0]
        entry = self._by_name.get(name)
        if entry is None or not hmac.compare_digest(admin_bearer(name, entry[1]).encode(),
                                                    bearer.encode()):
            return None
        return entry[0]

    def check_curve_key(self, public_z85: str) -> Identity | None:
        return self._by_curve_key.get(public_z85)


@dataclass
class ServerAuth:
    """How a server authenticates: its mechanism, what it accepts, its CURVE secret."""

    mechanism: str
    store: CredentialStore | None
    server_secret: str = ""

    @property
    def enabled(self) -> bool:
        return self.mechanism != NULL

    def configure(self, router: zmq.Socket, domain: bytes = ZAP_DOMAIN) -> None:
        """Make `router` (or another server socket) require the mechanism (before it
        binds); `domain` tells the ZAP handler which sockets it admits for."""
        if self.mechanism == CURVE:
            router.curve_server = True
            router.curve_secretkey = self.server_secret.encode()
        if self.enabled:
            router.zap_domain = domain


class ZapHandler(threading.Thread):
    """Answers ZeroMQ's authentication requests for one context (RFC 27)."""

    def __init__(self, context: zmq.Context, auth: ServerAuth) -> None:
        super().__init__(name="kvdepot-zap", daemon=True)
        assert auth.store is not None
        self._auth = auth
        self._store = auth.store
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Bound before the ROUTER accepts anyone: without a handler ZeroMQ lets every
        # CURVE client in.
        self._socket.bind(ZAP_ENDPOINT)
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                if self._socket.poll(200):
                    self._socket.send_multipart(self._answer(self._socket.recv_multipart()))
        except zmq.ContextTerminated:
            pass  # the server process is ending its context (serve._send_final_replies)
        finally:
            self._socket.close(linger=0)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _, mechanism, *credentials = frames
        identity, reason = self._check(domain, address.decode(errors="replace"),
                                       mechanism.decode(errors="replace"), credentials)
        if identity is None:
            # A client retries its handshake forever: one line per interval says so.
            refusals_log.warning("zap", "refused a connection from %s: %s",
                                 address.decode(errors="replace") or "ipc", reason)
            return [version, request_id, b"400", reason.encode(), b"", b""]
        return [version, request_id, b"200", b"OK", self._store.user_id(identity).encode(), b""]

    def _check(self, domain: bytes, address: str, mechanism: str, credentials: list[bytes]
               ) -> tuple[Identity | None, str]:
        if (domain not in (ZAP_DOMAIN, EVENTS_ZAP_DOMAIN)
                or mechanism.lower() != self._auth.mechanism):
            return None, "wrong domain or mechanism"
        identity, reason = self._check_credentials(address, mechanism, credentials)
        if identity is not None and domain == EVENTS_ZAP_DOMAIN and not identity.is_admin:
            return None, f"KV events need an admin credential ({identity.name!r} is not)"
        return identity, reason

    def _check_credentials(self, address: str, mechanism: str, credentials: list[bytes]
                           ) -> tuple[Identity | None, str]:
        self._store.reload(now=True)
        if len(credentials) != 1 or len(credentials[0]) != 32:
            return None, "malformed CURVE credentials"
        identity = self._store.check_curve_key(z85_encode(credentials[0]).decode())
        return identity, "" if identity else "unknown CURVE client key"

