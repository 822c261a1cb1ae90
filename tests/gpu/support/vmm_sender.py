"""Hands driver-mapped KV memory over to a server and lets another process register it:
`python -m tests.gpu.support.vmm_sender URL BLOCKS`. Prints the registration (msgpack,
hex) with this process's ticket on one line, then keeps the memory until its stdin
closes."""

from __future__ import annotations

import sys

import msgspec
import torch

from kvdepot.rpc.connection import DepotConnection
from tests.gpu.support.vmm_memory import DriverMappedKV
from tests.support.raw_registration import hand_over_memory


def main() -> int:
    url, blocks = sys.argv[1], int(sys.argv[2])
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    kv = DriverMappedKV(blocks, device)
    conn = DepotConnection(url)
    try:
        request, _ = hand_over_memory(conn, kv.caches)
        print(msgspec.msgpack.encode(request).hex(), flush=True)
        sys.stdin.read()
    finally:
        conn.close()
        kv.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
