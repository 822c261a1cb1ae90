"""Chaos: an engine process loads, checks and stores KV while the server is stopped,
continued, killed and restarted at random (seeded) moments. Zero wrong bytes, ever.

The engine runs `kvdepot.testbed.verified_workload`: every block's contents derive from its
tokens, every successful load is checked byte for byte, a finished store's blocks are
reused at once and a failed load's blocks are recomputed and watched, so a store or load
the server ran after the worker gave up on it shows up as wrong bytes.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

from kvdepot.testbed.server_process import ServerProcess
from tests.support.engine import EngineProcess
from tests.support.server import small_server

SEED = 9
FAULT_SECONDS = 45.0
QUIET_SECONDS = 10.0
"""A last stretch without faults, so whatever a stall left queued has run before the check."""


class FaultInjector(threading.Thread):
    def __init__(self, server: ServerProcess, seed: int) -> None:
        super().__init__(name="faults", daemon=True)
        self.server = server
        self.rng = random.Random(seed)
        self.stop_event = threading.Event()
        self.stalls = 0
        self.kills = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_event.wait(self.rng.uniform(0.5, 3.0)):
                if self.rng.random() < 0.7:
                    self._stall()
                else:
                    self._crash()
        except BaseException as exc:
            self.error = exc

    def _stall(self) -> None:
        pid = self.server.proc.pid
        os.kill(pid, signal.SIGSTOP)
        self.stalls += 1
        try:
            time.sleep(self.rng.uniform(1.2, 3.0))  # past the 1 s heartbeat, or not quite
        finally:
            os.kill(pid, signal.SIGCONT)

    def _crash(self) -> None:
        self.server.kill()
        self.kills += 1
        time.sleep(self.rng.uniform(0.0, 1.0))
        self.server = small_server(port=self.server.port, chunk_size=64).start()


def test_zero_wrong_bytes_under_stalls_crashes_and_restarts():
    server = small_server(chunk_size=64).start()
    engine = None
    faults = FaultInjector(server, SEED)
    try:
        engine = EngineProcess(server.url, heartbeat_interval=1.0, mq_timeout=2.0,
                               num_blocks=128)
        faults.start()
        counts = engine.workload_run(FAULT_SECONDS, SEED, timeout=600)
        faults.stop_event.set()
        faults.join()
        assert faults.error is None, faults.error
        counts = engine.workload_run(QUIET_SECONDS, SEED, timeout=600)
        counts = engine.workload_finish(timeout=120)
    finally:
        faults.stop_event.set()
        faults.join()
        if engine is not None:
            engine.close()
        faults.server.stop()
    print(f"chaos: {faults.stalls} stalls, {faults.kills} crashes; {counts}")
    assert faults.stalls > 0 and faults.kills > 0
    assert counts["hits"] > 0 and counts["verified_blocks"] > 0, counts
    assert counts["wrong_blocks"] == 0, counts
