"""Register KV tensors by hand, the way the worker client does, for error-path tests."""

from __future__ import annotations

import os
from typing import Any

import torch

from kvdepot.client.kv_export import export_kv_caches
from kvdepot.client.memory_handover import HandoverFiles, hand_over
from kvdepot.protocol import RegisterKVCache, RequestType
from kvdepot.rpc.connection import DepotConnection
from kvdepot.transfer.fence import ClientFence

WAIT = 300.0
FENCE = ClientFence(slots=16)
"""The fence every registration made here names (tests take slots from it)."""


def hand_over_memory(conn: DepotConnection, caches: dict[str, torch.Tensor],
                     block_size: int = 16) -> tuple[RegisterKVCache, list[int]]:
    """Export `caches`, hand their descriptors to the server; returns the registration
    (ticket filled in) and the descriptors."""
    files = HandoverFiles()
    handles, layers, _ = export_kv_caches(caches, block_size, files)
    fence = files.add(FENCE.fd, FENCE.nbytes)
    server = conn.call(RequestType.PING, timeout=WAIT)
    ticket = hand_over(server, conn.credential, files.fds, WAIT)
    return RegisterKVCache(model="m", world_size=1, rank=0, block_size=block_size,
                           allocations=handles, layers=layers, engine_pid=os.getpid(),
                           handover_ticket=ticket, fence=fence), files.fds


def register(conn: DepotConnection, caches: dict[str, torch.Tensor], **fields: Any) -> bytes:
    """Register over the connection's I/O socket (the one its submits use); returns the
    server's instance id."""
    request, _ = hand_over_memory(conn, caches)
    for name, value in fields.items():
        setattr(request, name, value)
    return conn.submit(RequestType.REGISTER_KV_CACHE, request).result(WAIT).instance_id
