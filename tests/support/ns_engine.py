"""A synthetic engine as a plain process, for namespaces the fork server cannot enter.

Run as `python -m tests.support.ns_engine URL CREDENTIALS` (inside `namespaces.isolated`):
it registers a small KV cache through the seed-compatible worker adapter, prints
{"ready": true}, then answers one JSON line per command read on stdin:

- {"op": "roundtrip", "seed": s}: fills blocks 0-3 with values drawn from s, stores their
  64 tokens, overwrites the blocks, looks them up and retrieves them ->
  {"hit": tokens the lookup found, "exact": whether every byte came back}
- {"op": "healthy"} -> {"healthy": the scheduler's and the worker's health}
"""

from __future__ import annotations

import json
import sys

import torch

from tests.support.engine import _Engine

BLOCKS = [0, 1, 2, 3]
TOKENS_PER_BLOCK = 16


def _roundtrip(engine: _Engine, seed: int) -> dict[str, object]:
    tokens = [(seed * 7919 + i) % 30000 for i in range(len(BLOCKS) * TOKENS_PER_BLOCK)]
    engine.fill_blocks(BLOCKS, seed)
    stored = [t.clone() for t in engine.read_blocks(BLOCKS)]
    engine.store(f"store-{seed}", tokens, BLOCKS, 0, len(tokens))
    engine.fill_value(BLOCKS, 0.0)
    hit = engine.lookup(f"load-{seed}", tokens, timeout=30)
    errors = engine.retrieve(f"load-{seed}", tokens, BLOCKS, 0, hit) if hit else set()
    back = engine.read_blocks(BLOCKS)
    exact = not errors and all(torch.equal(a, b) for a, b in zip(stored, back, strict=True))
    return {"hit": hit, "exact": exact}


def main() -> None:
    url, credentials = sys.argv[1], sys.argv[2]
    engine = _Engine(url, credentials=credentials, mq_timeout=30.0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "roundtrip":
            reply: dict[str, object] = _roundtrip(engine, command["seed"])
        elif command["op"] == "healthy":
            reply = {"healthy": list(engine.healthy())}
        else:
            break
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
