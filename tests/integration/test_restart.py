"""The server dies under a running engine: degraded mode, recovery, re-registration."""

import torch

from tests.support.server import small_server
from tests.support.waiting import wait_until

CHUNK = 64
TOKENS = list(range(40, 40 + 3 * CHUNK + 1))


def test_server_killed_and_restarted_under_a_running_engine(engines, server):
    engine = engines(heartbeat_interval=0.5)
    engine.fill(seed=1)
    engine.store("before", TOKENS, list(range(12)), 0, 3 * CHUNK)
    assert engine.lookup("warm", TOKENS) == 3 * CHUNK
    expected = engine.read_blocks(list(range(12)))

    # A store and a retrieve in flight when the server dies are drained, not hung.
    engine.submit_store("inflight", TOKENS, list(range(12)), 0, 3 * CHUNK)
    server.kill()
    wait_until(lambda: engine.healthy() == (False, False))
    sending, recving, _ = engine.get_finished({"inflight"})
    assert sending == {"inflight"} and recving == set()

    # Degraded mode: lookups answer 0, stores are skipped, loads fail as load errors.
    assert engine.lookup("down", TOKENS) == 0
    engine.store("down-store", TOKENS, list(range(12)), 0, 3 * CHUNK)
    assert engine.retrieve("down", TOKENS, list(range(16, 28)), 0, 3 * CHUNK) == set(
        range(16, 28))

    # Same port, new process: the engine resumes and re-registers by itself.
    restarted = small_server(port=server.port, chunk_size=CHUNK).start()
    try:
        wait_until(lambda: engine.healthy() == (True, True))
        assert engine.lookup("after-empty", TOKENS) == 0  # the new server starts empty
        engine.store("after", TOKENS, list(range(12)), 0, 3 * CHUNK)
        assert engine.lookup("after", TOKENS) == 3 * CHUNK
        engine.write_through_old_view(0.0)
        assert engine.retrieve("after", TOKENS, list(range(16, 28)), 0, 3 * CHUNK) == set()
        for a, b in zip(expected, engine.read_blocks(list(range(16, 28))), strict=True):
            assert torch.equal(a, b)
    finally:
        log = restarted.stop()
    assert "registered engine" in log


def test_a_client_started_while_the_server_is_down_fails_fast(server):
    from kvdepot.errors import ServerUnavailable
    from tests.support.engine import EngineError, EngineProcess

    server.kill()
    try:
        EngineProcess(server.url)
    except EngineError as exc:
        assert exc.name in ("ServerUnavailable", "ConnectionError")
        assert server.url in exc.message
    else:
        raise AssertionError("connecting to a dead server succeeded")
    assert issubclass(ServerUnavailable, ConnectionError)
