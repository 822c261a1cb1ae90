"""A CUDA registration names a torch reference-counter file that the server opens by
that name (with its own rights) and decrements at an unchecked offset when it lets go of
the memory. It must be the registering process's own counter. Checked before any CUDA
call, so this runs without a GPU."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from kvdepot.errors import InvalidRequest
from kvdepot.protocol import CudaIPCMemory, RequestType
from kvdepot.rpc.connection import DepotConnection
from tests.support.raw_registration import hand_over_memory

WAIT = 300.0
NOBODY = 65534


@pytest.fixture
def conn(server) -> Iterator[DepotConnection]:
    connection = DepotConnection(server.url)
    yield connection
    connection.close()


@pytest.fixture
def counter_file() -> Iterator[str]:
    """A torch-style counter name of this process, and its file in /dev/shm."""
    name = f"/torch_{os.getpid()}_12345_{id(object())}"
    with open("/dev/shm" + name, "wb") as f:
        f.write(b"\0" * 8 * 10000)
    yield name
    os.unlink("/dev/shm" + name)


def register_cuda(conn: DepotConnection, ref_counter: str, offset: int = 0) -> None:
    request, _ = hand_over_memory(conn, {"l0": torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)})
    request.allocations = [CudaIPCMemory(
        device_uuid="GPU-00000000-0000-0000-0000-000000000000", handle=b"\1" * 64, offset=0,
        nbytes=request.allocations[0].nbytes, ref_counter_handle=ref_counter.encode(),
        ref_counter_offset=offset)]
    conn.submit(RequestType.REGISTER_KV_CACHE, request).result(WAIT)


def test_a_counter_of_another_process_is_refused(conn, counter_file):
    other = counter_file.replace(f"_{os.getpid()}_", "_1_")
    with pytest.raises(InvalidRequest, match="not a torch counter of the registering process"):
        register_cuda(conn, other)
    with pytest.raises(InvalidRequest, match="not a torch counter"):
        register_cuda(conn, "/kvdepot-some-shm-object")


def test_an_offset_past_the_counters_is_refused(conn, counter_file):
    with pytest.raises(InvalidRequest, match="outside torch's 10000 counters"):
        register_cuda(conn, counter_file, offset=10000)


def test_a_counter_file_of_another_user_or_a_link_is_refused(conn, counter_file):
    os.chown("/dev/shm" + counter_file, NOBODY, NOBODY)
    with pytest.raises(InvalidRequest, match="not the registering user's"):
        register_cuda(conn, counter_file)
    link = f"/torch_{os.getpid()}_1_1"
    os.symlink("/dev/shm" + counter_file, "/dev/shm" + link)
    try:
        with pytest.raises(InvalidRequest, match="not the registering user's"):
            register_cuda(conn, link)
    finally:
        os.unlink("/dev/shm" + link)
    with pytest.raises(InvalidRequest, match="does not exist"):
        register_cuda(conn, f"/torch_{os.getpid()}_2_2")


def test_the_registering_processs_own_counter_passes_the_check(conn, counter_file):
    # It gets as far as the GPU: this host has none (or not this made-up one).
    with pytest.raises(InvalidRequest, match=r"CUDA device|not visible"):
        register_cuda(conn, counter_file)
