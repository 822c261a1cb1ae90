import pytest

from tests.support.engine import EngineProcess
from tests.support.server import small_server


@pytest.fixture
def server():
    srv = small_server().start()
    yield srv
    srv.stop()


@pytest.fixture
def engines_at():
    """Factory for engine processes connected to a given URL (a test's own server); all
    closed at the end."""
    started: list[EngineProcess] = []

    def start(url: str, **kwargs) -> EngineProcess:
        started.append(EngineProcess(url, **kwargs))
        return started[-1]

    yield start
    for engine in started:
        engine.close()


@pytest.fixture
def engines(server, engines_at):
    """Factory for engine processes connected to `server`."""
    return lambda **kwargs: engines_at(kwargs.pop("url", server.url), **kwargs)


@pytest.fixture
def redis_server(tmp_path):
    """A standalone redis-server on a free loopback port."""
    from tests.support.redis_servers import RedisProcess, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (scripts/bootstrap installs it as root)")
    server = RedisProcess(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_cluster(tmp_path):
    """Three masters with a replica each, on free loopback ports."""
    from tests.support.redis_servers import RedisClusterProcesses, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (scripts/bootstrap installs it as root)")
    cluster = RedisClusterProcesses(tmp_path / "redis-cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
