"""One engine process of `kvdepot bench transfer --engines N --tp T` (one rank of one
engine): builds its KV caches on its GPU (or in shared memory for `--device cpu`),
registers them as rank `rank` of `world_size`, then runs what the parent
(`transfer_engines`) asks, one JSON line each way:

- `warm`: stores until `warm_bytes` are stored -> the phase;
- `prepare` (`retrieves`): stores its retrieve set again if the phase retrieves -> ready;
- `run` (`name`, `seconds`, `stores`, `retrieves`): the phase -> the phase and when it
  started (`time.monotonic`, the same clock in every process of the host);
- `exit`, or the parent's end of input: unregisters and exits.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

from kvdepot.bench.transfer.child_process import ParentChannel
from kvdepot.bench.transfer.load import (
    Load,
    build_engine_kv,
    register_engine,
    run_phase,
    warm_up,
)
from kvdepot.testbed.kv_geometry import CPU_GEOMETRIES, CUDA_GEOMETRIES


@dataclass
class EngineConfig:
    server_url: str
    geometry: str
    device: str
    model: str
    world_size: int
    rank: int
    seed: int
    """Ranks of one engine share it (the same tokens); engines do not."""
    chunks_per_op: int
    inflight: int
    retrieve_set: int
    warm_bytes: int
    copy_mode: str


def main() -> int:
    config = EngineConfig(**json.loads(sys.argv[1]))
    channel = ParentChannel()
    geometry = next(g for g in CPU_GEOMETRIES + CUDA_GEOMETRIES if g.name == config.geometry)
    cuda = config.device == "cuda"
    kv = build_engine_kv(geometry, config.device, config.chunks_per_op, config.copy_mode)
    worker = register_engine(config.server_url, kv, config.model, config.world_size,
                             config.rank)
    try:
        load = Load(worker, kv.num_blocks, config.chunks_per_op, geometry.block_size, cuda,
                    kv.chunk_bytes, seed=config.seed)
        channel.send({"chunk_bytes": kv.chunk_bytes, "copy_path": kv.copy_path,
                      "mean_segment_bytes": kv.mean_segment_bytes,
                      "device": torch.cuda.get_device_name() if cuda else "cpu"})
        while (command := channel.receive()) is not None and command["do"] != "exit":
            if command["do"] == "warm":
                channel.send(asdict(warm_up(None, load, config.inflight, config.warm_bytes)))
            elif command["do"] == "prepare":
                if command["retrieves"]:
                    load.fill_retrieve_set(config.retrieve_set)
                channel.send({"ready": True})
            elif command["do"] == "run":
                started = time.monotonic()
                phase = run_phase(command["name"], None, load, command["seconds"],
                                  config.inflight, command["stores"], command["retrieves"])
                channel.send({"started": started, "phase": asdict(phase)})
            else:
                raise ValueError(f"unknown command {command!r}")
    finally:
        worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
