"""`kvdepot bench e2e --device cuda --own-hit-rounds N`: vLLM's own prefix-cache hit with
and without a connector, the engines side by side.

What a connector costs vLLM's own hit is a few milliseconds at most, and on a shared host
one engine's own hit drifts by more than that from one minute to the next, so engines run
one after the other (the rest of `bench e2e --device cuda`) are compared across different
minutes. Here every engine named lives at once on the one GPU, each with an equal share of
`--gpu-memory-utilization`; each holds the same prompts in its prefix cache, and in each of
N rounds every engine's own hit of every prompt runs in turn, the engines in a random
order: whatever the host does falls on all of them alike. Per engine and prompt length it
prints the median, quartiles and fastest wall time, the step (scheduled to first token) and
the difference from the first engine named; and the server's lookups and stores meanwhile
(kvdepot should send none: vLLM holds every prompt).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 900.0
HIT_TIMEOUT_S = 120.0


def check_engines(engines: list[str]) -> None:
    """ValueError unless every engine named can run in this mode."""
    from kvdepot.bench.e2e_gpu import ROUNDS_ENGINES

    refused = [e for e in engines if e not in ROUNDS_ENGINES]
    if refused:
        raise ValueError(f"--own-hit-rounds runs {', '.join(ROUNDS_ENGINES)} side by side, "
                         f"not {', '.join(refused)}")


def round_orders(engines: list[str], lengths: list[int], rounds: int,
                 seed: int = 5) -> list[tuple[int, str]]:
    """Every (prompt length, engine) own hit to run, in order: per round and length each
    engine once, the engines shuffled anew each time."""
    rng = random.Random(seed)
    order: list[tuple[int, str]] = []
    for _ in range(rounds):
        for length in lengths:
            turn = list(engines)
            rng.shuffle(turn)
            order.extend((length, engine) for engine in turn)
    return order


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of `values`: the order
    statistics k and n+1-k, k the largest with P(Binomial(n, 1/2) < k) <= (1-confidence)/2.
    Own hits have a long right tail (a slow host second), so no normal approximation.
    With too few values for that confidence, the whole range (-inf, inf)."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1.0 - confidence) / 2.0
    below, k = 0.0, 0  # below: P(Binomial(n, 1/2) < k)
    while k < n and below + (p := math.comb(n, k) / 2 ** n) <= tail:
        below += p
        k += 1
    if k == 0:
        return -math.inf, math.inf
    return ordered[k - 1], ordered[n - k]


def summarize(times: dict[str, dict[int, list[tuple[float, float | None]]]],
              lengths: list[int]) -> dict[int, dict[str, dict[str, float]]]:
    """Per length and engine, from (wall ms, step ms) pairs in round order: median,
    quartiles, fastest, median step, the median's difference from the first engine's, and
    the paired difference: per round, this engine's own hit less the first engine's of the
    same round (the host's drift cancels), its median and a 95% interval for it."""
    summary: dict[int, dict[str, dict[str, float]]] = {}
    for length in lengths:
        line: dict[str, dict[str, float]] = {}
        base: float | None = None
        base_walls: list[float] = []
        for engine, by_length in times.items():
            walls = [wall for wall, _ in by_length[length]]
            steps = [step for _, step in by_length[length] if step is not None]
            q1, _, q3 = (statistics.quantiles(walls, n=4, method="inclusive") if len(walls) > 1
                         else walls * 3)
            median = statistics.median(walls)
            if base is None:
                base, base_walls = median, walls
            paired = [wall - first for wall, first in zip(walls, base_walls, strict=True)]
            low, high = median_interval(paired)
            line[engine] = {"median_ms": median, "q1_ms": q1, "q3_ms": q3,
                            "fastest_ms": min(walls), "runs": len(walls),
                            "step_ms": statistics.median(steps) if steps else float("nan"),
                            "vs_first_ms": median - base,
                            "paired_ms": statistics.median(paired),
                            "paired_low_ms": low, "paired_high_ms": high}
        summary[length] = line
    return summary


def verdict(row: dict[str, float]) -> str:
    """What the paired interval says of an engine against the first one."""
    if row["paired_low_ms"] > 0:
        return "slower"
    if row["paired_high_ms"] < 0:
        return "faster"
    return "no difference shown"


def _engine_loop(model_dir: Path, engine: str, url: str | None, args: argparse.Namespace,
                 log_path: Path, lengths: list[int], commands: Connection) -> None:
    """One engine: build it, hold every prompt in vLLM's prefix cache, then run an own hit
    of the length each command names until told to stop (None)."""
    from kvdepot.bench import e2e_gpu
    from kvdepot.testbed.vllm_engine import quiet_vllm_logging, random_tokens, stderr_to

    quiet_vllm_logging()
    with stderr_to(log_path):
        llm = e2e_gpu._make_llm(model_dir, engine, url, e2e_gpu.max_model_len(lengths), args)
    try:
        rng = random.Random(1)  # the same prompts in every engine
        e2e_gpu.warm_up(llm, rng)
        prompts = {length: random_tokens(rng, length) for length in lengths}
        for prompt in prompts.values():
            e2e_gpu._timed(llm, prompt)  # cold: vLLM holds it from here on
            e2e_gpu._timed(llm, prompt)
        if url is None:
            e2e_gpu._let_stores_finish(None)
        else:
            from kvdepot.client.admin import AdminClient

            with AdminClient(url) as admin:
                e2e_gpu._let_stores_finish(admin)
        commands.send("ready")
        while (length := commands.recv()) is not None:
            wall, phases, _, cached = e2e_gpu._timed(llm, prompts[length])
            commands.send((wall * 1e3, phases.get("running_ms"), cached))
    finally:
        llm.llm_engine.engine_core.shutdown()


def _receive(conn: Connection, proc: Any, timeout: float, what: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"{what}: no answer within {timeout:g} s")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"{what}: the engine process exited (status {proc.exitcode}); "
                           "its error is in vLLM's log") from None


def main(args: argparse.Namespace) -> int:
    """The command: the model as `bench e2e --device cuda` writes it, a kvdepot server,
    the rounds; exit 2 on engines this mode cannot run or without a GPU."""
    from kvdepot.bench import e2e_gpu
    from kvdepot.testbed.measurement import machine, server_process

    try:
        engines = e2e_gpu.parse_engines(args.engines)
        check_engines(engines)
    except ValueError as exc:
        print(exc)
        return 2
    gpu = e2e_gpu.cuda_device_name()
    if gpu is None:
        return 2
    lengths = [int(n) for n in args.prompt_lengths.split(",")]
    print(f"kvdepot bench e2e --device cuda --own-hit-rounds {args.own_hit_rounds}: vLLM "
          f"{e2e_gpu._vllm_version()} on {gpu}; a Llama-3.1-8B-shaped model with {args.layers} "
          f"layers, bfloat16, {e2e_gpu.execution_mode(args)}; prompts {lengths}; engines "
          f"{', '.join(engines)}; {machine()}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    model_dir = e2e_gpu._model_dir(args.layers)
    log = Path(tempfile.gettempdir()) / f"kvdepot-bench-own-hit-rounds-{os.getpid()}.log"
    print(f"  vLLM's own log: {log}", flush=True)
    with server_process(e2e_gpu.CHUNK_SIZE, args.l1_size) as (url, _):
        rounds = run(model_dir, engines, url, args, lengths, log)
    if args.json:
        args.json.write_text(json.dumps(
            {**rounds, "gpu": gpu, "layers": args.layers, "vllm": e2e_gpu._vllm_version(),
             "cuda_graphs": args.cuda_graphs},
            indent=1, default=str))
    return 0


def run(model_dir: Path, engines: list[str], url: str, args: argparse.Namespace,
        lengths: list[int], log_path: Path) -> dict[str, Any]:
    """Start the engines one at a time (vLLM sizes its memory from what is free), run the
    rounds, print the table; returns what goes to --json."""
    from kvdepot.bench.e2e_gpu import KVDEPOT_ENGINES
    from kvdepot.client.admin import AdminClient
    from kvdepot.testbed.measurement import stop_process_tree

    check_engines(engines)
    share = argparse.Namespace(**{**vars(args), "gpu_memory_utilization":
                                  args.gpu_memory_utilization / len(engines)})
    ctx = mp.get_context("spawn")
    running: dict[str, tuple[Any, Connection]] = {}
    try:
        for engine in engines:
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_engine_loop, args=(
                model_dir, engine, url if engine in KVDEPOT_ENGINES else None, share, log_path,
                lengths, theirs))
            proc.start()
            theirs.close()
            running[engine] = (proc, ours)
            _receive(ours, proc, START_TIMEOUT_S, f"starting {engine}")
            print(f"  [{engine}] ready: every prompt held in vLLM's prefix cache", flush=True)
        with AdminClient(url) as admin:
            before = admin.stats()
        times: dict[str, dict[int, list[tuple[float, float | None]]]] = {
            e: {length: [] for length in lengths} for e in engines}
        cached: dict[tuple[str, int], set[int | None]] = {
            (e, length): set() for e in engines for length in lengths}
        for length, engine in round_orders(engines, lengths, args.own_hit_rounds):
            proc, conn = running[engine]
            conn.send(length)
            wall, step, tokens = _receive(conn, proc, HIT_TIMEOUT_S, f"{engine}'s own hit")
            times[engine][length].append((wall, step))
            cached[engine, length].add(tokens)
        with AdminClient(url) as admin:
            after = admin.stats()
    finally:
        for _, conn in running.values():
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc, _ in running.values():
            proc.join(60)
            if proc.is_alive():  # with vLLM's engine core under it, which holds the GPU
                stop_process_tree(proc.pid)
    sent = {key: after.get(key, 0) - before.get(key, 0)
            for key in ("lookups", "stores", "store_present_chunks", "retrieved_tokens")}
    summary = summarize(times, lengths)
    print(f"\nvLLM's own hit, engines side by side: {args.own_hit_rounds} rounds, each engine's "
          f"hit of each prompt in turn, in random order; {share.gpu_memory_utilization:.2f} of "
          "the GPU's memory each (ms; step: scheduled to first token)")
    print(f"{'tokens':>7} {'engine':<14} {'median':>7} {'q1':>7} {'q3':>7} {'fastest':>8} "
          f"{'step':>7} {'vs ' + engines[0]:>9} {'paired, 95% interval':<42}  "
          "prompt tokens vLLM did not compute")
    for length in lengths:
        for engine, row in summary[length].items():
            paired = ("" if engine == engines[0] else
                      f"{row['paired_ms']:+.2f} [{row['paired_low_ms']:+.2f}, "
                      f"{row['paired_high_ms']:+.2f}] {verdict(row)}")
            print(f"{length:>7} {engine:<14} {row['median_ms']:7.2f} {row['q1_ms']:7.2f} "
                  f"{row['q3_ms']:7.2f} {row['fastest_ms']:8.2f} {row['step_ms']:7.2f} "
                  f"{row['vs_first_ms']:+9.2f} {paired:<42}  "
                  + ", ".join(str(n) for n in sorted(cached[engine, length], key=str)))
    print(f"paired: per round, the engine's own hit less {engines[0]}'s of the same round; "
          "its median, and a distribution-free 95% interval for that median")
    if any(e in KVDEPOT_ENGINES for e in engines):
        print("kvdepot server during the rounds: " + ", ".join(
            f"{key} +{value:g}" for key, value in sent.items()))
    return {"own_hit_rounds": summary, "server_during_rounds": sent,
            "raw_own_hits": {e: {str(k): v for k, v in t.items()} for e, t in times.items()}}
