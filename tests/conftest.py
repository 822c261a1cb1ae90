import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdepot.testbed.server_process import ServerProcess
from tests.support.engine import EngineProcess
from tests.support.server import small_server

TESTS = Path(__file__).parent
LONGEST_FIRST = (
    "e2e/test_model_identity.py", "e2e/test_vllm_hits.py", "integration/test_shared_tier.py",
    "vllm_releases/test_vllm_releases.py",
    "e2e/test_workload_bench.py", "e2e/test_vllm_shared_tier.py",
    "e2e/test_vllm_preemption.py", "e2e/test_vllm_hybrid.py",
    "e2e/test_vllm_server_failure.py", "e2e/test_namespaces_vllm.py",
    "integration/test_port_squat.py",
    "integration/test_remote_pipelines.py", "e2e/test_vllm_full_hits.py",
    "integration/test_admin_api.py", "integration/test_transfer_bench.py",
    "integration/test_store_retrieve.py", "integration/test_security.py",
    "integration/test_errors.py", "e2e/test_openai_server.py", "e2e/test_hostile_requests.py",
    "integration/test_bounds.py", "integration/test_chaos.py", "integration/test_soak.py",
)
"""The test files that take longest (`pytest --durations` on the 2-core VM), longest
first. `make test` hands whole files to its processes in collection order
(`--no-loadscope-reorder`: pytest-xdist would otherwise send the files with the most
tests first, and the vLLM files, with few tests and long engine starts, last), so a long
file collected late would keep one process busy after the others are done. Only the order
depends on this list (a file missing from it runs after them)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}

    def order(item: pytest.Item) -> int:
        try:
            return rank.get(item.path.relative_to(TESTS).as_posix(), len(rank))
        except ValueError:
            return len(rank)

    items.sort(key=order)  # stable: each file's tests keep their order


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    srv = small_server().start()
    yield srv
    srv.stop()


@pytest.fixture
def engines_at() -> Iterator[Callable[..., EngineProcess]]:
    """Factory for engine processes connected to a given URL (a test's own server); all
    closed at the end."""
    started: list[EngineProcess] = []

    def start(url: str, **kwargs: Any) -> EngineProcess:
        started.append(EngineProcess(url, **kwargs))
        return started[-1]

    yield start
    for engine in started:
        engine.close()


@pytest.fixture
def engines(server: ServerProcess, engines_at: Callable[..., EngineProcess]
            ) -> Callable[..., EngineProcess]:
    """Factory for engine processes connected to `server` (a test with only servers of its
    own asks for `engines_at`, which does not start this one)."""
    return lambda **kwargs: engines_at(kwargs.pop("url", server.url), **kwargs)


@pytest.fixture
def state_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A state directory of the test's own, which the servers it starts and every client
    of this user find through KVDEPOT_STATE_DIR.

    A tempfile directory (private, 0700), not one under tmp_path: it is deleted when the
    test ends (pytest keeps recent runs' tmp_path), so credentials added to it do not
    outlive the test. KVDEPOT_ADMIN_URL and KVDEPOT_CREDENTIALS are cleared: a value from
    the shell that runs pytest would send a client to another server, or have it present
    a credential of another state directory.
    """
    with tempfile.TemporaryDirectory() as path:
        monkeypatch.setenv("KVDEPOT_STATE_DIR", path)
        monkeypatch.delenv("KVDEPOT_ADMIN_URL", raising=False)
        monkeypatch.delenv("KVDEPOT_CREDENTIALS", raising=False)
        yield Path(path)


@pytest.fixture
def redis_server(tmp_path):
    """A standalone redis-server on a free loopback port."""
    from tests.support.redis_servers import RedisProcess, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (scripts/bootstrap installs it as root)")
    server = RedisProcess(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def _worker_redis_cluster(tmp_path_factory):
    from tests.support.redis_servers import RedisClusterProcesses, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (scripts/bootstrap installs it as root)")
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("shared-redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def shared_redis_cluster(_worker_redis_cluster):
    """Three masters with a replica each, started once per test process and emptied for
    each test: for tests that neither stop nor reconfigure its nodes (those ask for
    `redis_cluster`). Starting a cluster costs seconds; emptying one, milliseconds."""
    _worker_redis_cluster.wait_healthy()
    with _worker_redis_cluster.client() as cluster:
        cluster.flushall(target_nodes=cluster.PRIMARIES)
    return _worker_redis_cluster


@pytest.fixture
def redis_cluster(tmp_path):
    """Three masters with a replica each, on free loopback ports, of the test's own."""
    from tests.support.redis_servers import RedisClusterProcesses, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (scripts/bootstrap installs it as root)")
    cluster = RedisClusterProcesses(tmp_path / "redis-cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
