"""`kvdepot bench e2e`: time to first token of a real vLLM engine, cold vs cached.

The model is a seeded random checkpoint (`checkpoint.py`). For each of several
8,192-token prompts, in an engine with KVDepotConnector:
  cold        the prompt computed from scratch (nothing cached anywhere),
  kvdepot hit the same prompt after vLLM's prefix cache was emptied, loaded from kvdepot,
and in an engine without a connector, the same prompts:
  cold        computed from scratch,
  vLLM hit    the same prompt again at once, from vLLM's own prefix cache (the baseline:
              vLLM recomputes the last block of a prompt it holds whole).
Each hit's greedy token is compared with its engine's cold run. Then the correctness check
with its control (`correctness.py`) on a prompt nearly as long, and throughput with no
hits at all (every prompt unique) in both engines. Each engine is a fresh process. Set
VLLM_CPU_NUM_OF_RESERVED_CPU=1 (the default here) so both engines compute on one core and
timings compare.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdepot.bench.e2e_gpu import add_arguments as add_gpu_arguments
from kvdepot.options import DEFAULTS
from kvdepot.testbed.measurement import in_spawned_process, machine, server_process

if TYPE_CHECKING:
    from kvdepot.client.admin import AdminClient
    from kvdepot.testbed.correctness import CorrectnessReport


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("e2e", help="vLLM TTFT: cold, vLLM prefix-cache hit, kvdepot hit")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: vLLM on CPU (vllm-cpu); cuda: vLLM on a GPU, the engines and "
                        "figures of `e2e_gpu.py` (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--chunk-size", type=int, default=DEFAULTS.chunk_size,
                   help="the server's chunk size; vLLM CPU's block size is 128 "
                        "(default %(default)s)")
    p.add_argument("--prompts", type=int, default=3,
                   help="prompts for the TTFT medians (0: throughput only)")
    p.add_argument("--throughput-prompts", type=int, default=8)
    p.add_argument("--throughput-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=None,
                   help="vLLM's block size in both engines (a multiple of 32 on CPU; default: "
                        "vLLM's, 128 on CPU)")
    p.add_argument("--no-tails", action="store_true",
                   help="the connector keeps whole chunks only (kvdepot.tails=false)")
    p.add_argument("--repeats", type=int, default=3,
                   help="throughput batches per engine; the median is reported")
    add_gpu_arguments(p)
    p.set_defaults(run=run)


def _ttft_phase(llm: Any, admin: AdminClient | None, rng: random.Random,
                args: argparse.Namespace) -> dict[str, list[Any]]:
    """With a connector (`admin` given): cold and kvdepot hit per prompt; without one:
    cold and vLLM prefix-cache hit. Both draw the same prompts from the same seed."""
    from kvdepot.testbed.vllm_engine import evict_local_cache, generate, random_tokens

    generate(llm, [random_tokens(rng, 512)], 1)  # warm-up: first-call overheads
    hit_name = "kvdepot" if admin is not None else "vllm"
    times: dict[str, list[Any]] = {"cold": [], hit_name: [], "loaded": [], "same_token": []}
    for _ in range(args.prompts):
        prompt = random_tokens(rng, args.prompt_tokens)
        evict_local_cache(llm)
        cold, (cold_out,) = generate(llm, [prompt], 1)
        if admin is not None:
            evict_local_cache(llm)  # the hit can only come from kvdepot
            before = admin.stats()["retrieved_tokens"]
        hit, (hit_out,) = generate(llm, [prompt], 1)
        loaded = 0 if admin is None else int(admin.stats()["retrieved_tokens"] - before)
        times["cold"].append(cold)
        times[hit_name].append(hit)
        times["loaded"].append(loaded)
        times["same_token"].append(hit_out.token_ids == cold_out.token_ids)
        label = "kvdepot hit" if admin is not None else "vLLM hit (no connector)"
        print(f"  prompt {len(times['cold'])}: cold {cold * 1e3:8.0f} ms, {label} "
              f"{hit * 1e3:6.0f} ms"
              + (f" ({loaded} tokens loaded)" if admin is not None else "")
              + f", greedy token {'same as' if times['same_token'][-1] else 'DIFFERS FROM'}"
              " cold", flush=True)
    return times


def _correctness_phase(llm: Any, admin: AdminClient, rng: random.Random, args: argparse.Namespace
                       ) -> CorrectnessReport:
    from kvdepot.testbed.correctness import check_correctness, engine_ask, probe_length
    from kvdepot.testbed.vllm_engine import random_tokens

    # One chunk short of the TTFT prompts, so the output tokens fit the engine's length.
    length = probe_length(args.chunk_size, max(1, args.prompt_tokens // args.chunk_size - 1))
    report = check_correctness(engine_ask(llm, admin),
                               random_tokens(rng, length), random_tokens(rng, length),
                               args.chunk_size, tails=not args.no_tails)
    print(f"  correctness check done ({length}-token prompt)", flush=True)
    return report


def _engine_process(model_dir: Path, url: str | None, args: argparse.Namespace,
                    log_path: Path, out: Any) -> None:
    from kvdepot.testbed.vllm_engine import make_engine, shutdown_engine, throughput

    llm = make_engine(model_dir, url, args.prompt_tokens + 256, log_path,
                      block_size=args.block_size, connector={"tails": not args.no_tails})
    # Shut the engine down even on an error: its processes would otherwise keep this one
    # from exiting, and the error from being reported.
    try:
        result: dict[str, Any] = {}
        rng = random.Random(1)
        if url is not None:
            from kvdepot.client.admin import AdminClient

            with AdminClient(url) as admin:
                if args.prompts:
                    result["ttft"] = _ttft_phase(llm, admin, rng, args)
                result["correctness"] = _correctness_phase(llm, admin, rng, args)
        elif args.prompts:
            result["ttft"] = _ttft_phase(llm, None, rng, args)
        # Distinct seeds per engine: nothing either engine computes can be cached already.
        result["throughput"] = throughput(llm, args.throughput_prompts, args.throughput_tokens,
                                          args.output_tokens, args.repeats,
                                          seed=2 if url else 3)
    finally:
        shutdown_engine(llm)
    out.put(result)


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda":
        if args.own_hit_rounds > 0:
            from kvdepot.bench.own_hit_rounds import main as own_hits_side_by_side

            return own_hits_side_by_side(args)
        from kvdepot.bench.e2e_gpu import run as run_on_gpu

        return run_on_gpu(args)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    from kvdepot.testbed.checkpoint import LLAMA_CONFIG, seeded_checkpoint

    geometry = (f"{LLAMA_CONFIG['num_hidden_layers']} layers, hidden "
                f"{LLAMA_CONFIG['hidden_size']}, {LLAMA_CONFIG['num_key_value_heads']} KV "
                f"heads x {LLAMA_CONFIG['head_dim']}, vocab {LLAMA_CONFIG['vocab_size']}")
    print(f"kvdepot bench e2e: vLLM (CPU, float32, seeded random weights; {geometry}); "
          f"{args.prompt_tokens}-token prompts; chunk size {args.chunk_size}; vLLM block "
          f"size {args.block_size or 'its default'}; tails {'off' if args.no_tails else 'on'}; "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU={os.environ['VLLM_CPU_NUM_OF_RESERVED_CPU']}; "
          f"{machine()}", flush=True)
    model_dir = seeded_checkpoint(LLAMA_CONFIG)
    vllm_log = Path(tempfile.gettempdir()) / f"kvdepot-bench-e2e-vllm-{os.getpid()}.log"
    print(f"  vLLM logs errors only; its engines' warnings go to {vllm_log}", flush=True)
    with server_process(args.chunk_size, "4GiB") as (url, _):
        with_connector = in_spawned_process(_engine_process, model_dir, url, args, vllm_log)
        without = in_spawned_process(_engine_process, model_dir, None, args, vllm_log)

    print()
    if "ttft" in with_connector:
        ttft, base = with_connector["ttft"], without["ttft"]
        cold = statistics.median(ttft["cold"])
        base_cold = statistics.median(base["cold"])
        local, hit = statistics.median(base["vllm"]), statistics.median(ttft["kvdepot"])
        aligned = args.prompt_tokens % args.chunk_size == 0
        goal = ("0.5x, a chunk-aligned prompt" if aligned else "1.1x, without tails"
                if args.no_tails else "0.3x")
        print(f"  median TTFT over {args.prompts} prompts of {args.prompt_tokens} tokens:")
        print(f"    cold prefill, no connector      {base_cold * 1e3:9.0f} ms")
        print(f"    cold prefill, KVDepotConnector  {cold * 1e3:9.0f} ms")
        print(f"    vLLM prefix-cache hit           {local * 1e3:9.0f} ms   (no connector: "
              "the baseline)")
        print(f"    kvdepot hit                     {hit * 1e3:9.0f} ms   {hit / local:7.2f}x "
              f"the vLLM hit (goal <= {goal}); "
              f"{int(statistics.median(ttft['loaded']))} tokens loaded")
        same = sum(ttft["same_token"]) + sum(base["same_token"])
        print(f"    greedy token of every hit the same as its engine's cold run: "
              f"{same} of {2 * args.prompts}")
    rates_on, rates_off = with_connector["throughput"], without["throughput"]
    tput_on, tput_off = statistics.median(rates_on), statistics.median(rates_off)
    print(f"  throughput, every prompt unique ({args.throughput_prompts} x "
          f"{args.throughput_tokens} tokens + {args.output_tokens} generated), median of "
          f"{args.repeats} batches:")
    print(f"    with KVDepotConnector {tput_on:9.1f} tokens/s   "
          f"({', '.join(f'{r:.1f}' for r in rates_on)})")
    print(f"    without a connector   {tput_off:9.1f} tokens/s   "
          f"({', '.join(f'{r:.1f}' for r in rates_off)})   ratio {tput_on / tput_off:.3f} "
          "(goal >= 0.97)")
    report: CorrectnessReport = with_connector["correctness"]
    print("\n".join(report.lines()))
    tokens_differ = not all(with_connector.get("ttft", {}).get("same_token", [])
                            + without.get("ttft", {}).get("same_token", []))
    return 1 if report.failures() or tokens_differ else 0
