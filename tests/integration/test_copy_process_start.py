"""A GPU copy process that cannot start (here: no GPU at all) fails the call that needed
it with the reason, and is not started again at once for every call after it.

The copy path itself needs a GPU: tests/gpu/test_copy_process_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

from kvdepot.errors import ServerError
from kvdepot.transfer.copy_process import client
from kvdepot.transfer.host_pool import allocate_shared_pool


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_copy_process_that_cannot_start_is_reported_and_backed_off(monkeypatch) -> None:
    _pool, fd = allocate_shared_pool(1 << 20)  # kept mapped while the processes try to start
    processes = client.CopyProcesses(fd, 1 << 20, pin=False, channels=3)
    try:
        with pytest.raises(ServerError, match=r"for cuda:0 did not start: it exited with "
                                              r"status 1"):
            processes.running(0)
        # Within the back-off the next call fails at once, saying when it tries again.
        with pytest.raises(ServerError, match=r"starts again in \d"):
            processes.running(0)
        # After it, a new process is started (and fails the same way here).
        monkeypatch.setattr(client, "FIRST_BACKOFF", 0.0)
        processes._backoff.clear()
        with pytest.raises(ServerError, match="did not start"):
            processes.running(0)
    finally:
        processes.close()
        os.close(fd)
