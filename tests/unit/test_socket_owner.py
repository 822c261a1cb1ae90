"""The kernel's answer to "whose is this loopback connection's client end?"."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from kvdepot.rpc.socket_owner import SocketOwners
from tests.support.as_user import NOBODY, as_user


def test_the_owner_of_a_connection_is_the_uid_of_its_client_end():
    owners = SocketOwners()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, remote = server.accept()
            with accepted:
                assert owners.owner(remote, accepted.getsockname()) == os.getuid()
        # A connection that does not exist has no owner.
        assert owners.owner(("127.0.0.1", 1), ("127.0.0.1", port)) is None


def test_another_users_client_end_is_theirs():
    owners = SocketOwners()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        hold = (f"import socket, sys; s = socket.create_connection(('127.0.0.1', {port})); "
                "sys.stdin.read()")
        child = subprocess.Popen(as_user(sys.executable, "-c", hold), stdin=subprocess.PIPE)
        try:
            accepted, remote = server.accept()
            with accepted:
                assert owners.owner(remote, accepted.getsockname()) == NOBODY
        finally:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(30)
