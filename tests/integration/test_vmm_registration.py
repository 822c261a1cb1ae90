"""A registration of driver-mapped (VMM) CUDA memory is checked before any GPU is
involved, so this runs on a server without one: a descriptor that is a file or a socket,
an index past the handover, sizes that do not hold together and a mix with CPU memory
are refused with the reason; sound claims get as far as the GPU (tests/gpu maps them)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator

import pytest
import torch

from kvdepot.errors import InvalidRequest
from kvdepot.protocol import CudaVMMMemory, RegisterKVCache, RequestType
from kvdepot.rpc.connection import DepotConnection
from tests.support import raw_registration
from tests.support.raw_registration import hand_over_memory

WAIT = 300.0
GRANULE = 2 << 20
LAYER = {"l0": torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)}
NBYTES = LAYER["l0"].untyped_storage().nbytes()


@pytest.fixture
def conn(server) -> Iterator[DepotConnection]:
    connection = DepotConnection(server.url)
    yield connection
    connection.close()


def _socket() -> int:
    a, b = socket.socketpair()
    b.close()
    return a.detach()


def vmm_registration(conn: DepotConnection, monkeypatch: pytest.MonkeyPatch,
                     descriptor: Callable[[], int] | None, **claims: int) -> RegisterKVCache:
    """A registration whose one allocation is driver-mapped memory at handover index 0,
    that descriptor being `descriptor()` (None: the layer's own memfd)."""
    real = raw_registration.export_kv_caches

    def export(caches, block_size, files, groups=None):  # type: ignore[no-untyped-def]
        handles, layers, aliases = real(caches, block_size, files, groups)
        if descriptor is not None:
            os.close(files.fds[0])
            files.fds[0] = descriptor()
        return handles, layers, aliases

    monkeypatch.setattr(raw_registration, "export_kv_caches", export)
    request, fds = hand_over_memory(conn, LAYER)
    os.close(fds[0])
    fields = {"fd_index": 0, "allocation_bytes": GRANULE, "offset": 0, "nbytes": NBYTES,
              **claims}
    request.allocations = [CudaVMMMemory(device_uuid="GPU-00000000-0000-0000-0000-000000000000",
                                         **fields)]
    return request


def register(conn: DepotConnection, request: RegisterKVCache) -> None:
    conn.submit(RequestType.REGISTER_KV_CACHE, request).result(WAIT)


@pytest.mark.parametrize("kind, descriptor", [("a file", None), ("a socket", _socket)])
def test_a_descriptor_that_is_no_cuda_export_is_refused(server, conn, monkeypatch, kind,
                                                        descriptor) -> None:
    request = vmm_registration(conn, monkeypatch, descriptor)
    with pytest.raises(InvalidRequest, match=f"descriptor is {kind}, not an export of CUDA"):
        register(conn, request)
    assert server.stats()["registered_engines"] == 0


def _dev_null() -> int:
    return os.open("/dev/null", os.O_RDWR)


@pytest.mark.parametrize("claims, message", [
    ({"fd_index": 3}, "fd_index 3 is outside the 2 file descriptors"),
    ({"offset": GRANULE - 4096}, r"claims bytes \[2093056, 2125824\) of an allocation of "
                                 "2097152"),
    ({"allocation_bytes": 0}, "claims no bytes"),
])
def test_claims_that_do_not_hold_together_are_refused(server, conn, monkeypatch, claims,
                                                      message) -> None:
    request = vmm_registration(conn, monkeypatch, _dev_null, **claims)
    with pytest.raises(InvalidRequest, match=message):
        register(conn, request)
    assert server.stats()["registered_engines"] == 0


def test_sound_claims_get_as_far_as_the_gpu(server, conn, monkeypatch) -> None:
    request = vmm_registration(conn, monkeypatch, _dev_null)
    with pytest.raises(InvalidRequest, match=r"CUDA device|not visible"):
        register(conn, request)
    assert server.alive()


def test_driver_mapped_and_cpu_memory_do_not_mix(server, conn, monkeypatch) -> None:
    request = vmm_registration(conn, monkeypatch, _dev_null)
    cpu, _ = hand_over_memory(conn, LAYER)
    request.allocations = [*request.allocations, *cpu.allocations]
    with pytest.raises(InvalidRequest, match="all CPU or all CUDA memory"):
        register(conn, request)
