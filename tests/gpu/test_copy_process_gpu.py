"""Each GPU's copy process (transfer/copy_process) fails alone and never outlives the server.

Killed while a retrieve waits on it, that retrieve is reported as a load error (the engine
recomputes), the server stays up, and the next copies run byte-exact in a new copy process
into which the registration was opened again: the engine does not register again. A server
that exits, cleanly or killed, takes its copy processes with it.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from kvdepot.integrations.vllm.mp_adapter import LoadStoreOp
from kvdepot.testbed.server_process import ServerProcess, child_pids
from tests.gpu.support.depot_server import start_server
from tests.gpu.support.engine import BLOCKS_PER_CHUNK, CHUNK, Engine
from tests.gpu.support.kv_layouts import BLOCK
from tests.support.waiting import wait_until


def copy_processes(server: ServerProcess) -> set[int]:
    found = set()
    for pid in child_pids(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"kvdepot.transfer.copy_process.main" in f.read():
                    found.add(pid)
        except OSError:
            continue
    return found


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"  # exited, not yet reaped
    except OSError:
        return True


def test_a_killed_copy_process_fails_only_its_copies_and_a_new_one_serves_the_engine(
        tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    server = start_server("auto", log)
    engine = Engine(server.url, "flash_attn")
    try:
        assert engine.round_trip(1)
        [first] = copy_processes(server)
        rng = random.Random(2)
        tokens = [rng.randrange(1, 30000) for _ in range(2 * CHUNK)]
        n = 2 * BLOCKS_PER_CHUNK
        engine.fill(list(range(n)), 3)
        engine.store(tokens, list(range(n)))
        before = server.stats()
        # Stopped, it takes the retrieve's copy but never answers; killed, the server's
        # wait for the answer ends at once.
        os.kill(first, signal.SIGSTOP)
        target = list(range(n, 2 * n))
        engine.adapter.submit_retrieve_request(
            "doomed", LoadStoreOp(token_ids=tokens, block_ids=target, start=0,
                                  end=len(target) * BLOCK), engine.event())
        wait_until(lambda: server.stats()["transfers_in_flight"] >= 1,
                   "the retrieve reaching the copy process")
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: "doomed" in engine.adapter.get_finished(set())[1],
                   "the retrieve failing")
        assert engine.adapter.get_block_ids_with_load_errors() == set(target)
        assert server.stats()["retrieve_errors"] == before["retrieve_errors"] + 1
        assert server.alive()

        # The next copies start a new process (after a short back-off) and open the
        # registration in it; the engine is never told to register again.
        deadline = time.monotonic() + 30
        while True:
            try:
                assert engine.round_trip(4), "a round trip through the new copy process " \
                    "returned other bytes"
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        [second] = copy_processes(server)
        assert second != first
        assert server.stats()["registered_engines"] == 1
        assert log.read_text().count("registered engine #") == 1
    finally:
        engine.close()
        server.stop()
    assert gone(second), "the copy process outlived its server's clean stop"


def test_a_killed_server_takes_its_copy_processes_with_it(tmp_path: Path) -> None:
    server = start_server("auto", tmp_path / "server.log")
    engine = Engine(server.url, "flash_attn")
    try:
        assert engine.round_trip(5)
        [pid] = copy_processes(server)
        server.kill()
        wait_until(lambda: gone(pid), "the copy process exiting with its server")
    finally:
        engine.close()


class _UnopenableEvent:
    """Stands in for a CUDA event made where the server cannot open it (another IPC or PID
    namespace): its interprocess handle names no event of this machine's driver."""

    def ipc_handle(self) -> bytes:
        return bytes(range(64))


def test_an_event_the_server_cannot_open_fails_its_operation_only(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Opening the engine's event fails in the copy process: that store fails with a clear
    error, and the copy process (and with it every other engine's copies) lives on."""
    server = start_server("auto", tmp_path / "server.log")
    engine = Engine(server.url, "flash_attn")
    try:
        assert engine.round_trip(1)
        [process] = copy_processes(server)
        before = server.stats()
        rng = random.Random(3)
        tokens = [rng.randrange(1, 30000) for _ in range(2 * CHUNK)]
        blocks = list(range(2 * BLOCKS_PER_CHUNK))
        engine.adapter.submit_store_request(
            "unopenable", LoadStoreOp(token_ids=tokens, block_ids=blocks, start=0,
                                      end=len(blocks) * BLOCK), _UnopenableEvent())
        wait_until(lambda: "unopenable" in engine.adapter.get_finished({"unopenable"})[0],
                   "the store with an unopenable event finishing")
        after = server.stats()
        assert after["store_errors"] == before["store_errors"] + 1
        assert after["stored_chunks"] == before["stored_chunks"]
        # The server's reason reaches the engine's log.
        assert "cannot be opened in the server" in caplog.text
        assert copy_processes(server) == {process}
        assert engine.round_trip(2)
    finally:
        engine.close()
        server.stop()
