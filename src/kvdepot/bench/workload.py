"""`kvdepot bench workload`: what users run to judge a KV cache, through vLLM's HTTP API.

One vLLM OpenAI-compatible server (the documented `api_server` command, streaming, the
client timing the first token) without a connector, then the same with KVDepotConnector
and a real `kvdepot serve`, each running the same requests in the same order:

  long-document QA  several documents read once (the warm-up round), then several
                    questions about each, interleaved across the documents so that vLLM's
                    own KV cache (sized with `--kv-cache-memory-bytes` to hold only part
                    of them) has evicted a document by the time it is asked about again;
  multi-round chat  several users, each with a long conversation so far, taking turns;
                    every turn's prompt is the whole history, answers included;
  no reuse          unique prompts, for throughput with nothing to reuse.

Several requests are in flight at once. Reported per scenario and engine: mean, p50 and
p90 TTFT, output throughput, and the share of prompt tokens loaded from kvdepot (vLLM's
`vllm:prompt_tokens_by_source_total`, beside kvdepot's own counters); a PNG draws TTFT per
request over time for both engines. The model is the seeded random checkpoint
(`checkpoint.py`), so each answer depends on the whole prompt, and the kvdepot engine's
greedy tokens are checked against the no-connector engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvdepot.options import DEFAULTS
from kvdepot.testbed.measurement import machine, server_process
from kvdepot.testbed.vllm_engine import random_tokens

ENGINES = ("no connector", "kvdepot")
SCENARIOS = ("qa_warmup", "qa", "chat", "no_reuse")
TITLES = {"qa_warmup": "documents read once (QA warm-up)", "qa": "long-document QA",
          "chat": "multi-round chat", "no_reuse": "no reuse (unique prompts)"}
VLLM_BLOCK = 128
"""vLLM CPU's KV block size in tokens."""
QA_TTFT_GOAL = 4.0
THROUGHPUT_GOAL = 0.97


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("workload", help="long-document QA, multi-round chat and unique prompts "
                                        "through vLLM's HTTP server, without and with kvdepot")
    p.add_argument("--model", choices=("large", "medium", "small"), default="medium",
                   help="seeded random Llama (kvdepot.testbed.checkpoint; default %(default)s)")
    p.add_argument("--chunk-size", type=int, default=DEFAULTS.chunk_size)
    p.add_argument("--l1-size", default="8GiB",
                   help="the server's CPU memory, populated at start (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight at once")
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--document-tokens", type=int, default=4096)
    p.add_argument("--questions", type=int, default=4,
                   help="questions per document after the warm-up round")
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--chat-context-tokens", type=int, default=4096,
                   help="each user's conversation so far when the benchmark starts")
    p.add_argument("--rounds", type=int, default=3, help="turns per user")
    p.add_argument("--user-tokens", type=int, default=128, help="tokens a user adds per turn")
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--unique-prompts", type=int, default=32)
    p.add_argument("--unique-tokens", type=int, default=2048)
    p.add_argument("--unique-output", type=int, default=32)
    p.add_argument("--vllm-kv-tokens", type=int, default=None,
                   help="vLLM's own KV cache in tokens (default: half the documents' tokens)")
    p.add_argument("--plot", type=Path, default=Path("kvdepot-bench-workload.png"),
                   help="where to draw TTFT per request over time (default %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tails", action="store_true",
                   help="the connector keeps whole chunks only (kvdepot.tails=false), to "
                        "measure what tails bring")
    p.set_defaults(run=run)


# ---- the requests ---------------------------------------------------------------------

@dataclass
class Record:
    """One request as the client saw it; times in seconds from the scenario's start."""

    key: str
    start: float
    ttft: float
    end: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    token_ids: list[int] = field(repr=False)
    events: int


def _record(key: str, answer: Any, origin: float) -> Record:
    return Record(key, answer.sent - origin, answer.ttft, answer.finished - origin,
                  answer.prompt_tokens, answer.cached_tokens, len(answer.token_ids),
                  answer.token_ids, answer.events)


def qa_requests(args: argparse.Namespace) -> tuple[list[tuple[str, list[int]]],
                                                   list[tuple[str, list[int]]]]:
    """(warm-up round, question rounds): (key, prompt) pairs, questions interleaved across
    the documents (every document's question 1, then every document's question 2, ...)."""
    rng = random.Random(f"qa-{args.seed}")
    documents = [random_tokens(rng, args.document_tokens) for _ in range(args.documents)]
    questions = [[random_tokens(rng, args.question_tokens) for _ in range(args.questions + 1)]
                 for _ in range(args.documents)]
    warmup = [(f"doc{d}-q0", documents[d] + questions[d][0]) for d in range(args.documents)]
    rounds = [(f"doc{d}-q{q}", documents[d] + questions[d][q])
              for q in range(1, args.questions + 1) for d in range(args.documents)]
    return warmup, rounds


def unique_requests(args: argparse.Namespace) -> list[tuple[str, list[int]]]:
    rng = random.Random(f"unique-{args.seed}")
    return [(f"unique{i}", random_tokens(rng, args.unique_tokens))
            for i in range(args.unique_prompts)]


def _run_list(server: Any, requests: list[tuple[str, list[int]]], max_tokens: int,
              concurrency: int) -> tuple[list[Record], float]:
    """Send in order, `concurrency` in flight; (records, wall seconds)."""
    origin = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda r: server.complete(r[1], max_tokens), requests))
    records = [_record(key, a, origin) for (key, _), a in zip(requests, answers, strict=True)]
    return records, max(r.end for r in records)


def _run_chat(server: Any, args: argparse.Namespace) -> tuple[list[Record], float]:
    """Every user takes `rounds` turns, each once the previous answer came back; ready
    turns are served first come, first served by `concurrency` senders, so the users take
    turns round-robin (a user who just got an answer queues behind the others)."""
    rng = random.Random(f"chat-{args.seed}")
    histories = [random_tokens(rng, args.chat_context_tokens) for _ in range(args.users)]
    turns = [[random_tokens(rng, args.user_tokens) for _ in range(args.rounds)]
             for _ in range(args.users)]
    ready: queue.Queue[tuple[int, int, list[int]] | None] = queue.Queue()
    for u in range(args.users):
        ready.put((u, 0, histories[u] + turns[u][0]))
    records: list[Record] = []
    errors: list[BaseException] = []
    remaining = [args.users * args.rounds]
    lock = threading.Lock()
    origin = time.perf_counter()

    def sender() -> None:
        while (item := ready.get()) is not None:
            u, r, prompt = item
            try:
                answer = server.complete(prompt, args.reply_tokens)
            except BaseException as exc:  # reported by the caller
                errors.append(exc)
                answer = None
            with lock:
                if answer is not None:
                    records.append(_record(f"user{u}-turn{r}", answer, origin))
                remaining[0] -= 1
                finished = remaining[0] == 0 or answer is None
            if answer is not None and r + 1 < args.rounds:
                ready.put((u, r + 1, prompt + answer.token_ids + turns[u][r + 1]))
            elif finished:
                for _ in range(args.concurrency):
                    ready.put(None)

    threads = [threading.Thread(target=sender) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    records.sort(key=lambda r: r.start)
    return records, max(r.end for r in records)


# ---- one engine -----------------------------------------------------------------------

def _loaded_by_kvdepot(url: str | None) -> int | None:
    """Tokens the server has sent to engines so far (None without a server)."""
    if url is None:
        return None
    from kvdepot.client.admin import AdminClient

    with AdminClient(url) as admin:
        return int(admin.stats()["retrieved_tokens"])


def _counted_sources(server: Any, before: dict[str, float], prompt_tokens: int
                     ) -> dict[str, float]:
    """vLLM's prompt tokens by source since `before`, once it has counted
    `prompt_tokens` of them (its metrics may trail the last answer a little)."""
    deadline = time.monotonic() + 30
    while True:
        after = server.prompt_tokens_by_source()
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
        if sum(delta.values()) >= prompt_tokens or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


def _scenario(server: Any, url: str | None,
              body: Callable[[], tuple[list[Record], float]]) -> dict[str, Any]:
    sources_before = server.prompt_tokens_by_source()
    loaded_before = _loaded_by_kvdepot(url)
    records, wall = body()
    sources = _counted_sources(server, sources_before, sum(r.prompt_tokens for r in records))
    loaded_after = _loaded_by_kvdepot(url)
    return {"records": [asdict(r) for r in records], "wall_s": wall,
            "prompt_tokens_by_source": sources,
            "kvdepot_sent_tokens": None if url is None else loaded_after - loaded_before}


def run_engine(model_dir: Path, url: str | None, args: argparse.Namespace, kv_bytes: int,
               max_len: int, log_path: Path) -> dict[str, Any]:
    """Every scenario on one fresh api_server (with KVDepotConnector at `url`, or none)."""
    from kvdepot.testbed.openai_server import OpenAIServer, api_server_argv, api_server_env
    from kvdepot.testbed.server_process import free_port

    port = free_port()
    started = time.perf_counter()
    argv = api_server_argv(model_dir, port, url, kv_bytes, max_len,
                           connector_options={"tails": not args.no_tails})
    with OpenAIServer(argv, api_server_env(), port, log_path) as server:
        print(f"  {ENGINES[url is not None]}: vLLM up in {time.perf_counter() - started:.0f} s",
              flush=True)
        server.complete(random_tokens(random.Random("warm-up"), 256), 2)  # first-call overheads
        warmup, rounds = qa_requests(args)
        c = args.concurrency
        result: dict[str, Any] = {}
        steps: list[tuple[str, Callable[[], tuple[list[Record], float]]]] = [
            ("qa_warmup", lambda: _run_list(server, warmup, args.answer_tokens, c)),
            ("qa", lambda: _run_list(server, rounds, args.answer_tokens, c)),
            ("chat", lambda: _run_chat(server, args)),
            ("no_reuse", lambda: _run_list(server, unique_requests(args),
                                           args.unique_output, c)),
        ]
        for name, body in steps:
            result[name] = _scenario(server, url, body)
            stats = summarize(result[name])
            print(f"    {TITLES[name]}: {len(result[name]['records'])} requests, mean TTFT "
                  f"{stats['ttft_mean_ms']:.0f} ms, {stats['output_tokens_per_s']:.1f} output "
                  f"tokens/s, {stats['kvdepot_share']:.0%} of prompt tokens from kvdepot",
                  flush=True)
    return result


# ---- the report -----------------------------------------------------------------------

def summarize(scenario: dict[str, Any]) -> dict[str, float]:
    records = scenario["records"]
    ttft = np.asarray([r["ttft"] for r in records]) * 1e3
    sources = scenario["prompt_tokens_by_source"]
    counted = sum(sources.values())
    return {
        "requests": len(records),
        "ttft_mean_ms": float(ttft.mean()),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p90_ms": float(np.percentile(ttft, 90)),
        "output_tokens_per_s": sum(r["output_tokens"] for r in records) / scenario["wall_s"],
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "kvdepot_share": sources.get("external_kv_transfer", 0.0) / counted if counted else 0.0,
        "vllm_cache_share": sources.get("local_cache_hit", 0.0) / counted if counted else 0.0,
    }


def _check(checks: list[dict[str, Any]], name: str, passed: bool, detail: str) -> None:
    checks.append({"check": name, "passed": bool(passed), "detail": detail})


def checks_for(report: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every one can fail: each compares measured output with what must hold."""
    checks: list[dict[str, Any]] = []
    runs = report["engines"]
    expected = {"qa_warmup": args.answer_tokens, "qa": args.answer_tokens,
                "chat": args.reply_tokens, "no_reuse": args.unique_output}
    for engine in ENGINES:
        bad = [r["key"] for s in SCENARIOS for r in runs[engine][s]["records"]
               if r["output_tokens"] != expected[s] or r["events"] < 2]
        _check(checks, f"{engine}: every answer streamed, with the tokens asked for",
               not bad, f"wrong: {bad[:5]}" if bad else "all")
    reference = {(s, r["key"]): r["token_ids"] for s in SCENARIOS
                 for r in runs["no connector"][s]["records"]}
    compared = differ = reused = 0
    first_diff = ""
    for s in SCENARIOS:
        for r in runs["kvdepot"][s]["records"]:
            compared += 1
            reused += r["cached_tokens"] > 0
            if reference.get((s, r["key"])) != r["token_ids"]:
                differ += 1
                first_diff = first_diff or f"{s} {r['key']}"
    _check(checks, "kvdepot engine: greedy tokens identical to the no-connector engine's",
           differ == 0 and compared > 0,
           f"{compared - differ} of {compared} answers identical ({reused} of them reused "
           "cached KV)" + (f"; first difference: {first_diff}" if differ else ""))
    qa = runs["kvdepot"]["qa"]
    external = qa["prompt_tokens_by_source"].get("external_kv_transfer", 0.0)
    _check(checks, "kvdepot engine, QA rounds: vLLM loaded prompt tokens from kvdepot",
           external > 0, f"{external:.0f} tokens (vLLM's metric)")
    _check(checks, "kvdepot engine, QA rounds: kvdepot sent at least what vLLM counts as "
           "loaded", 0 < external <= qa["kvdepot_sent_tokens"],
           f"kvdepot sent {qa['kvdepot_sent_tokens']} tokens, vLLM loaded {external:.0f}")
    leaked = sum(runs["no connector"][s]["prompt_tokens_by_source"].get(
        "external_kv_transfer", 0.0) for s in SCENARIOS)
    _check(checks, "no-connector engine: no prompt token loaded from outside", leaked == 0,
           f"{leaked:.0f} tokens")
    for engine in ENGINES:
        short = [s for s in SCENARIOS
                 if sum(runs[engine][s]["prompt_tokens_by_source"].values())
                 < report["summary"][engine][s]["prompt_tokens"]]
        _check(checks, f"{engine}: vLLM's metric counted every prompt token the client sent",
               not short, f"short in {short}" if short else "all scenarios")
    return checks


def goals_for(report: dict[str, Any]) -> list[dict[str, Any]]:
    s = report["summary"]
    qa = s["no connector"]["qa"]["ttft_mean_ms"] / s["kvdepot"]["qa"]["ttft_mean_ms"]
    tput = (s["kvdepot"]["no_reuse"]["output_tokens_per_s"]
            / s["no connector"]["no_reuse"]["output_tokens_per_s"])
    return [{"goal": f"long-document QA: mean TTFT at least {QA_TTFT_GOAL:g}x lower with "
                     "kvdepot", "value": qa, "met": qa >= QA_TTFT_GOAL},
            {"goal": f"no reuse: output throughput at least {THROUGHPUT_GOAL} of no "
                     "connector", "value": tput, "met": tput >= THROUGHPUT_GOAL}]


def table(report: dict[str, Any]) -> list[str]:
    s = report["summary"]
    lines = ["| scenario | engine | requests | mean TTFT | p50 TTFT | p90 TTFT | output tokens/s "
             "| prompt tokens from kvdepot | from vLLM's cache |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for scenario in SCENARIOS:
        for engine in ENGINES:
            m = s[engine][scenario]
            lines.append(
                f"| {TITLES[scenario] if engine == ENGINES[0] else ''} | {engine} | "
                f"{m['requests']} | {m['ttft_mean_ms']:,.0f} ms | {m['ttft_p50_ms']:,.0f} ms | "
                f"{m['ttft_p90_ms']:,.0f} ms | {m['output_tokens_per_s']:.1f} | "
                f"{m['kvdepot_share']:.1%} | {m['vllm_cache_share']:.1%} |")
        off, on = s["no connector"][scenario], s["kvdepot"][scenario]
        lines.append(f"| | kvdepot / no connector | | "
                     f"{off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f}x lower | "
                     f"{off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x | "
                     f"{off['ttft_p90_ms'] / on['ttft_p90_ms']:.2f}x | "
                     f"{on['output_tokens_per_s'] / off['output_tokens_per_s']:.3f} | | |")
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ("qa", "chat", "no_reuse")
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), squeeze=False)
    for ax, scenario in zip(axes[0], shown, strict=True):
        for engine, marker in zip(ENGINES, ("o", "s"), strict=True):
            records = report["engines"][engine][scenario]["records"]
            ax.plot([r["start"] for r in records], [r["ttft"] for r in records], marker,
                    label=engine, markersize=4, alpha=0.8)
        ax.set_title(TITLES[scenario])
        ax.set_xlabel("request sent (s from scenario start)")
        ax.set_ylabel("TTFT (s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(textwrap.fill(report["title"], 150), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the command ----------------------------------------------------------------------

def kv_bytes_per_token(config: dict[str, Any]) -> int:
    return (config["num_hidden_layers"] * 2 * config["num_key_value_heads"]
            * config["head_dim"] * 4)  # float32


def _longest_prompt(args: argparse.Namespace) -> int:
    chat = args.chat_context_tokens + args.rounds * (args.user_tokens + args.reply_tokens)
    return max(args.document_tokens + args.question_tokens + args.answer_tokens, chat,
               args.unique_tokens + args.unique_output)


def _vllm_kv_tokens(args: argparse.Namespace, longest: int) -> int:
    wanted = args.vllm_kv_tokens or args.documents * args.document_tokens // 2
    needed = args.concurrency * longest + VLLM_BLOCK
    if wanted < needed:
        if args.vllm_kv_tokens:
            raise SystemExit(f"--vllm-kv-tokens {wanted} cannot hold {args.concurrency} requests "
                             f"of up to {longest} tokens at once; give at least {needed}")
        wanted = needed
    return -(-wanted // VLLM_BLOCK) * VLLM_BLOCK


COUNTS = ("concurrency", "documents", "document_tokens", "questions", "question_tokens",
          "answer_tokens", "users", "chat_context_tokens", "rounds", "user_tokens",
          "reply_tokens", "unique_prompts", "unique_tokens", "unique_output")


def run(args: argparse.Namespace) -> int:
    from kvdepot.testbed.checkpoint import SIZES, seeded_checkpoint

    for name in COUNTS:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    config = SIZES[args.model]
    longest = _longest_prompt(args)
    max_len = -(-longest // VLLM_BLOCK) * VLLM_BLOCK
    kv_tokens = _vllm_kv_tokens(args, max_len)
    kv_bytes = kv_tokens * kv_bytes_per_token(config)
    title = (f"kvdepot bench workload: vLLM api_server (CPU, float32, seeded random "
             f"{args.model} Llama: {config['num_hidden_layers']} layers, hidden "
             f"{config['hidden_size']}); {args.concurrency} requests in flight; vLLM KV cache "
             f"{kv_tokens} tokens; chunk size {args.chunk_size}; {machine()}")
    print(title, flush=True)
    print(f"  QA: {args.documents} documents x {args.document_tokens} tokens "
          f"({args.documents * args.document_tokens} together), {args.questions} questions "
          f"each; chat: {args.users} users, {args.chat_context_tokens}-token histories, "
          f"{args.rounds} turns; no reuse: {args.unique_prompts} x {args.unique_tokens} tokens",
          flush=True)
    print(f"  vLLM's KV cache: --kv-cache-memory-bytes {kv_bytes} ({kv_tokens} tokens; "
          "VLLM_CPU_KVCACHE_SPACE unset, it would override it)", flush=True)
    model_dir = seeded_checkpoint(config)
    log_path = Path(tempfile.gettempdir()) / f"kvdepot-bench-workload-vllm-{os.getpid()}.log"
    print(f"  vLLM servers log to {log_path}", flush=True)
    engines: dict[str, Any] = {}
    engines["no connector"] = run_engine(model_dir, None, args, kv_bytes, max_len, log_path)
    with server_process(args.chunk_size, args.l1_size) as (url, _):
        engines["kvdepot"] = run_engine(model_dir, url, args, kv_bytes, max_len, log_path)
        from kvdepot.client.admin import AdminClient

        with AdminClient(url) as admin:
            stats = admin.stats()
    memory = {"used_bytes": int(stats["used_bytes"]), "tail_bytes": int(stats["tail_bytes"]),
              "stored_tails": int(stats["stored_tails"]), "hit_tails": int(stats["hit_tails"])}

    report: dict[str, Any] = {
        "title": title, "settings": {k: str(v) if isinstance(v, Path) else v
                                     for k, v in vars(args).items() if k != "run"},
        "vllm_kv_tokens": kv_tokens, "engines": engines, "kvdepot_memory": memory,
        "summary": {e: {s: summarize(engines[e][s]) for s in SCENARIOS} for e in ENGINES}}
    report["checks"] = checks_for(report, args)
    report["goals"] = goals_for(report)
    plot(report, args.plot)
    report["plot"] = str(args.plot)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))

    print()
    print("\n".join(table(report)))
    print(f"\n  TTFT per request over time: {args.plot}")
    share = memory["tail_bytes"] / memory["used_bytes"] if memory["used_bytes"] else 0.0
    print(f"  kvdepot's CPU memory at the end: {memory['used_bytes'] / 2**20:.1f} MiB held, "
          f"{memory['tail_bytes'] / 2**20:.1f} MiB of it tails ({share:.1%}); "
          f"{memory['stored_tails']} tails stored, {memory['hit_tails']} hit")
    for goal in report["goals"]:
        print(f"  goal: {goal['goal']}: {goal['value']:.2f} "
              f"({'met' if goal['met'] else 'NOT met'})")
    for check in report["checks"]:
        print(f"  {'PASS' if check['passed'] else 'FAIL'}  {check['check']}: {check['detail']}")
    return 0 if all(c["passed"] for c in report["checks"]) else 1
