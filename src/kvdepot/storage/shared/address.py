"""Where the shared tier lives and how to log in: `--shared-tier` URLs and their secrets.

    redis://HOST:PORT[/DB]                  one server (Redis or Valkey)
    rediss://HOST:PORT[/DB]                 the same over TLS
    redis+cluster://HOST:PORT[,HOST:PORT]   a cluster, from any of its nodes
    rediss+cluster://...                    a cluster over TLS

An ACL user may be named in the URL (`redis://USER@HOST:PORT`) or by `--shared-tier-user`;
the password comes from `--shared-tier-password-file` or `$KVDEPOT_SHARED_TIER_PASSWORD`
(`$KVDEPOT_REMOTE_PASSWORD`, its old name, for one release), never from the command line:
a URL carrying a password is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

PASSWORD_VARIABLE = "KVDEPOT_SHARED_TIER_PASSWORD"
OLD_PASSWORD_VARIABLE = "KVDEPOT_REMOTE_PASSWORD"
"""Read when `PASSWORD_VARIABLE` is unset, for one release after the rename."""
SOCKET_READ_BYTES = 1 << 20
"""redis-py reads replies in slices of this size: values are pieces of megabytes, and
its 64 KiB default makes a system call per 64 KiB."""
_SCHEMES = {"redis": (False, False), "rediss": (False, True),
            "redis+cluster": (True, False), "rediss+cluster": (True, True)}


@dataclass(frozen=True)
class SharedTierAddress:
    nodes: tuple[tuple[str, int], ...]
    cluster: bool
    tls: bool
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def display(self) -> str:
        """The URL without secrets, for logs."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        user = f"{self.username}@" if self.username else ""
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{user}{hosts}" + (f"/{self.db}" if self.db else "")


def parse_shared_tier_url(url: str) -> SharedTierAddress:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise ValueError(f"--shared-tier {url!r}: expected redis://HOST:PORT, "
                         "rediss://HOST:PORT or redis+cluster://HOST:PORT[,HOST:PORT...]")
    cluster, tls = _SCHEMES[scheme]
    username = None
    if "@" in rest:
        credentials, rest = rest.rsplit("@", 1)
        if ":" in credentials:
            raise ValueError("--shared-tier: a password on the command line is refused (it would "
                             "be visible to every user in the process list); put it in a file "
                             f"given by --shared-tier-password-file, or in ${PASSWORD_VARIABLE}")
        username = unquote(credentials) or None
    hosts, _, db_text = rest.partition("/")
    db = 0
    if db_text:
        if cluster or not db_text.isdigit():
            raise ValueError(f"--shared-tier {url!r}: a database number is a non-negative integer, "
                             "and clusters have only database 0")
        db = int(db_text)
    nodes = []
    for node in hosts.split(","):
        host, colon, port = node.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--shared-tier {url!r}: {node!r} is not HOST:PORT")
        nodes.append((host.strip("[]"), int(port)))
    if len(nodes) > 1 and not cluster:
        raise ValueError(f"--shared-tier {url!r}: several nodes need redis+cluster://")
    return SharedTierAddress(tuple(nodes), cluster, tls, db, username)


def with_secrets(address: SharedTierAddress, username: str | None, password_file: str | None
                 ) -> SharedTierAddress:
    """The address with its ACL user and password: the file's first line, else the
    environment variable, else none."""
    password = None
    if password_file:
        path = Path(password_file)
        try:
            password = path.read_text().splitlines()[0] if path.stat().st_size else ""
        except (OSError, IndexError) as exc:
            raise ValueError(f"--shared-tier-password-file {password_file}: cannot read a password "
                             f"from it ({exc})") from None
    elif os.environ.get(PASSWORD_VARIABLE):
        password = os.environ[PASSWORD_VARIABLE]
    elif os.environ.get(OLD_PASSWORD_VARIABLE):
        password = os.environ[OLD_PASSWORD_VARIABLE]
    return SharedTierAddress(address.nodes, address.cluster, address.tls, address.db,
                             username or address.username, password)


def connect(address: SharedTierAddress, timeout: float, ca_file: str | None = None) -> Any:
    """A redis-py client (Redis, or RedisCluster with the topology loaded) that never
    retries by itself: the tier's circuit breaker decides when to try again. Plain TCP
    connections send big values without copying them (`ZeroCopyConnection`); TLS ones
    are redis-py's own."""
    from redis import ConnectionPool, Redis, RedisCluster
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode
    from redis.retry import Retry

    from kvdepot.storage.shared.zero_copy_connection import ZeroCopyConnection

    common: dict[str, Any] = dict(
        username=address.username, password=address.password, socket_timeout=timeout,
        socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0), health_check_interval=0,
        socket_read_size=SOCKET_READ_BYTES)
    if address.tls:
        common.update(ssl=True, ssl_ca_certs=ca_file)
    if address.cluster:
        cluster: dict[str, Any] = dict(
            startup_nodes=[ClusterNode(h, p) for h, p in address.nodes],
            require_full_coverage=False, reinitialize_steps=1, **common)
        if address.tls:
            return RedisCluster(**cluster)
        # redis-py gives the nodes' pools a connection class only when the cluster client
        # is made from a URL (the first node's; the others stay startup nodes).
        host, port = address.nodes[0]
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return RedisCluster.from_url(f"redis://{netloc}", connection_class=ZeroCopyConnection,
                                     **cluster)
    host, port = address.nodes[0]
    if address.tls:
        return Redis(host=host, port=port, db=address.db, **common)
    return Redis.from_pool(ConnectionPool(connection_class=ZeroCopyConnection, host=host,
                                          port=port, db=address.db, **common))
