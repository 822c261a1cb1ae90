"""Real Redis servers for the tests and `kvdepot bench remote`: a standalone one, or a
cluster of masters (with a replica each if asked) on free loopback ports in a given
directory. scripts/bootstrap installs redis-server where it is missing (as root);
`$KVDEPOT_REDIS_SERVER` picks another binary (a build of its own, or valkey-server)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

from kvdepot.testbed.server_process import free_port

NODE_TIMEOUT_MS = 1000
"""cluster-node-timeout: how soon a replica takes over from a master that stopped."""

ALLOCATOR_SETTINGS = "dirty_decay_ms:-1"
"""jemalloc's options for the servers, as docs/shared-tier.md advises operators: keep the
pages of freed memory for reuse. By default jemalloc hands them back to the kernel after
about 10 s, so after a pause each master's first big reply (a piece it copies into a reply
buffer) faults its pages in again: about 1,000 faults per 4 MiB piece, which made the
first reads after a pause up to twice as slow as warm ones on the VM (docs/shared-tier.md)."""
ALLOCATOR_VARIABLES = ("MALLOC_CONF", "JE_MALLOC_CONF")
"""Where jemalloc reads its options: a system jemalloc (Debian's redis-server and
valkey-server) the first, the je_-prefixed copy in upstream builds the second."""


SERVER_VARIABLE = "KVDEPOT_REDIS_SERVER"
"""A redis-server (or valkey-server) to run instead of the one on PATH; the redis-cli
(valkey-cli) beside it builds clusters, else the one on PATH."""


def redis_server_binary() -> str | None:
    """redis-server, if it and redis-cli (which builds clusters) are installed. Every
    binary is looked up on $PATH (and runs with the caller's $LD_LIBRARY_PATH), so a
    Debian package unpacked with `dpkg -x` anywhere is found once its usr/bin is on
    $PATH."""
    chosen = os.environ.get(SERVER_VARIABLE)
    if chosen and shutil.which(chosen) is None:
        raise ValueError(f"${SERVER_VARIABLE}={chosen!r} is not an executable file")
    return (chosen or shutil.which("redis-server")) if redis_cli_binary() else None


def redis_cli_binary() -> str | None:
    chosen = os.environ.get(SERVER_VARIABLE)
    if chosen:
        path = Path(chosen)
        beside = path.with_name(path.name.replace("server", "cli"))
        if beside != path and shutil.which(beside) is not None:
            return str(beside)
    return shutil.which("redis-cli")


BENCHMARK_VARIABLE = "KVDEPOT_REDIS_BENCHMARK"
"""The C client `kvdepot bench remote` measures beside kvdepot, if not the one beside the
server (valkey-benchmark 8.0's cluster mode GETs keys its SETs did not write)."""


def redis_benchmark_binary() -> str | None:
    """$KVDEPOT_REDIS_BENCHMARK, else redis-benchmark (valkey-benchmark) beside the chosen
    server, else the one on PATH."""
    override = os.environ.get(BENCHMARK_VARIABLE)
    if override:
        if shutil.which(override) is None:
            raise ValueError(f"${BENCHMARK_VARIABLE}={override!r} is not an executable file")
        return override
    chosen = os.environ.get(SERVER_VARIABLE)
    if chosen:
        path = Path(chosen)
        beside = path.with_name(path.name.replace("server", "benchmark"))
        if beside != path and shutil.which(beside) is not None:
            return str(beside)
    return shutil.which("redis-benchmark")


class RedisProcess:
    """One redis-server; `start()` again after `stop()` or `kill()` restarts it on the
    same port and directory (a cluster node keeps its identity in nodes.conf there)."""

    def __init__(self, directory: Path, *, cluster: bool = False, password: str | None = None,
                 port: int | None = None, maxmemory: str = "512mb",
                 tls: Path | None = None, io_threads: int = 1) -> None:
        """`tls`: a directory holding server.crt, server.key and ca.crt (`make_test_ca`):
        the server then speaks TLS only. `io_threads` above 1: Redis's threaded socket
        reads and writes (what an operator turns on for big values on a many-core host)."""
        self.port = port or free_port()
        self.directory = directory / str(self.port)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.args = [redis_server_binary() or "redis-server", "--port", str(self.port),
                     "--bind", "127.0.0.1", "--dir", str(self.directory), "--save", "",
                     "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning",
                     "--logfile", str(self.directory / "redis.log"),
                     "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
        if cluster:
            # The bus port is chosen too: by default it is the port + 10000, which may be
            # taken (or past 65535).
            self.bus_port = free_port()
            self.args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                          "--cluster-port", str(self.bus_port),
                          "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                          # A master otherwise waits 5 s for more replicas before it sends
                          # a new replica its data, and a cluster is not healthy until then.
                          "--repl-diskless-sync-delay", "0"]
        if io_threads > 1:
            self.args += ["--io-threads", str(io_threads), "--io-threads-do-reads", "yes"]
        if password:
            self.args += ["--requirepass", password]
        self.tls = tls
        if tls is not None:
            self.args[self.args.index("--port") + 1] = "0"
            self.args += ["--tls-port", str(self.port), "--tls-cert-file", str(tls / "server.crt"),
                          "--tls-key-file", str(tls / "server.key"), "--tls-ca-cert-file",
                          str(tls / "ca.crt"), "--tls-auth-clients", "no"]
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> RedisProcess:
        # What it prints before its log file is open (a bad option) goes to the log too.
        with open(self.directory / "redis.log", "ab") as early_output:
            environment = {**os.environ,
                           **dict.fromkeys(ALLOCATOR_VARIABLES, ALLOCATOR_SETTINGS)}
            self.proc = subprocess.Popen(self.args, stdout=early_output, stderr=early_output,
                                         env=environment)
        client = self.client()
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} did not start "
                                       f"(exit status {self.proc.poll()}); the end of its "
                                       f"log:\n{self._log_tail()}") from None
                time.sleep(0.02)
            except redis.AuthenticationError:
                break
        client.close()
        return self

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = (self.directory / "redis.log").read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def client(self) -> redis.Redis:
        tls = {} if self.tls is None else {"ssl": True, "ssl_ca_certs": str(self.tls / "ca.crt")}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=5, **tls)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def make_test_ca(directory: Path) -> Path:
    """A throw-away CA and a certificate for 127.0.0.1 signed by it (openssl)."""
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.crt", "-days", "1", "-subj", "/CN=kvdepot test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
            "server.csr", "-subj", "/CN=127.0.0.1")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "san.ext")
    return directory


class RedisClusterProcesses:
    """Masters and `replicas` replicas of each (`redis-cli --cluster create`)."""

    def __init__(self, directory: Path, masters: int = 3, replicas: int = 1,
                 maxmemory: str = "512mb", io_threads: int = 1) -> None:
        self.nodes = [RedisProcess(directory, cluster=True, maxmemory=maxmemory,
                                   io_threads=io_threads)
                      for _ in range(masters * (1 + replicas))]
        self.masters = masters
        self.replicas = replicas

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes[:2])

    def start(self) -> RedisClusterProcesses:
        for node in self.nodes:
            node.start()
        if self.masters < 3 and self.replicas == 0:
            self._assign_slots()  # `redis-cli --cluster create` wants 3 masters at least
            self.wait_healthy()
            return self
        subprocess.run([redis_cli_binary() or "redis-cli", "--cluster", "create",
                        *(n.address for n in self.nodes), "--cluster-replicas", str(self.replicas),
                        "--cluster-yes"], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, timeout=60)
        self.wait_healthy()
        return self

    def _assign_slots(self) -> None:
        """A cluster of one or two masters, built by hand: the slots split evenly, then
        every node introduced to the first."""
        slots = 16384
        for index, node in enumerate(self.nodes):
            first, last = index * slots // len(self.nodes), (index + 1) * slots // len(self.nodes)
            with node.client() as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last - 1)
                if index:
                    c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port,
                                      self.nodes[0].bus_port)

    def client(self) -> RedisCluster:
        live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in live],
                            socket_timeout=5)

    def wait_healthy(self, timeout: float = 60) -> None:
        """Until every live node says the cluster is ok, every replica is in sync with
        its master and every master answers."""
        deadline = time.monotonic() + timeout
        while True:
            if self._healthy():
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis cluster did not become healthy")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        try:
            for node in live:
                with node.client() as c:
                    if c.cluster("info")["cluster_state"] != "ok":
                        return False
                    # A replica that never synced with its master cannot take over from it.
                    replication = c.info("replication")
                    if (replication["role"] == "slave"
                            and replication.get("master_link_status") != "up"):
                        return False
            with self.client() as cluster:
                cluster.ping(target_nodes=RedisCluster.PRIMARIES)
        except (redis.RedisError, KeyError, IndexError):
            return False
        return True

    def master_of(self, key: str) -> RedisProcess:
        with self.client() as cluster:
            node = cluster.get_node_from_key(key)
        return next(n for n in self.nodes if n.port == node.port)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def restart(self) -> None:
        """Every node stopped, then started again on its port with its nodes.conf."""
        self.stop()
        for node in self.nodes:
            node.start()
        self.wait_healthy()
