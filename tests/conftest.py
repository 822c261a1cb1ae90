import pytest

from tests.support.engine import EngineProcess
from tests.support.server import small_server


@pytest.fixture
def server():
    srv = small_server().start()
    yield srv
    srv.stop()


@pytest.fixture
def engines(server):
    """Factory for engine processes connected to `server`; all closed at the end."""
    started: list[EngineProcess] = []

    def start(**kwargs) -> EngineProcess:
        engine = EngineProcess(kwargs.pop("url", server.url), **kwargs)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.close()
