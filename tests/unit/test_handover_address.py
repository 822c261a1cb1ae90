"""Which handover socket a worker connects to: the path in the server's socket directory,
where it knows where it sees that directory, else the abstract name."""

from __future__ import annotations

import pytest

from kvdepot.client.memory_handover import SOCKET_DIR_ENV, handover_address
from kvdepot.protocol import Pong

WITH_DIRECTORY = Pong("boot", "@kvdepot-handover-x", 1, 0, "handover.sock")
WITHOUT = Pong("boot", "@kvdepot-handover-x", 1, 0)


@pytest.fixture(autouse=True)
def no_directory_named(monkeypatch):
    monkeypatch.delenv(SOCKET_DIR_ENV, raising=False)


def test_an_ipc_url_in_the_directory_names_it():
    assert handover_address(WITH_DIRECTORY, "ipc:///run/kvdepot/kvdepot.sock") == \
        "/run/kvdepot/handover.sock"


def test_a_tcp_engine_names_its_view_of_the_directory(monkeypatch):
    monkeypatch.setenv(SOCKET_DIR_ENV, "/mnt/kv")
    assert handover_address(WITH_DIRECTORY, "tcp://10.0.0.5:5555") == "/mnt/kv/handover.sock"


def test_without_a_directory_the_abstract_name_serves_the_server_s_namespaces(monkeypatch):
    assert handover_address(WITH_DIRECTORY, "tcp://127.0.0.1:5555") == "@kvdepot-handover-x"
    monkeypatch.setenv(SOCKET_DIR_ENV, "/mnt/kv")
    assert handover_address(WITHOUT, "tcp://127.0.0.1:5555") == "@kvdepot-handover-x"
