"""`kvdepot bench route`: KV-aware routing on vLLM's own KV events against round-robin.

Two "nodes" on this machine, each a `kvdepot serve` and a vLLM api_server (CPU) with
KVDepotConnector on that depot, publishing KV events. vLLM's own KV cache holds about one
document, so most of what an engine has read lives only in its node's depot: a router
that cannot see the depot sees almost nothing.

Long-document QA, run once per policy on documents of its own: every document is read
once (the warm-up), then the questions about all of them come in a seeded random order,
one request at a time (so every policy sees the same load and no request waits on
another). The KV-aware router (`kv_router.py`) sends each prompt to the engine holding
the longest prefix of it, GPU or depot; the same router looking at GPU blocks only is what
a router saw before kvdepot's blocks were in the events; round-robin alternates. Reported
per policy: mean and p50 TTFT of the questions, and how many went to an engine that held
their document.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvdepot.bench.workload import VLLM_BLOCK, kv_bytes_per_token
from kvdepot.options import DEFAULTS
from kvdepot.testbed.measurement import machine, server_process
from kvdepot.testbed.vllm_engine import random_tokens

POLICIES = ("round-robin", "kv-aware, GPU blocks only", "kv-aware")
"""The middle one is a router as it was before kvdepot's blocks joined the events: it
sees only what vLLM's own cache holds."""
EVENTS_SETTLE_S = 1.0
"""Pause after the warm-up, so the last stores' events reach the router (an engine passes
kvdepot's events on at its next step, and the warm-up's last step is behind it)."""


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("route", help="KV-aware routing on vLLM's KV events (which carry "
                                     "kvdepot's blocks) against round-robin, two engines")
    p.add_argument("--model", choices=("large", "medium", "small"), default="medium",
                   help="seeded random Llama (kvdepot.testbed.checkpoint; default %(default)s)")
    p.add_argument("--chunk-size", type=int, default=DEFAULTS.chunk_size)
    p.add_argument("--documents", type=int, default=6)
    p.add_argument("--document-tokens", type=int, default=2048)
    p.add_argument("--questions", type=int, default=3, help="questions per document")
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def _requests(policy: str, args: argparse.Namespace
              ) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """(warm-up prompts, (document, prompt) of every question in arrival order)."""
    rng = random.Random(f"route-{policy}-{args.seed}")
    documents = [random_tokens(rng, args.document_tokens) for _ in range(args.documents)]
    warmup = [d + random_tokens(rng, args.question_tokens) for d in documents]
    questions = [(i, d + random_tokens(rng, args.question_tokens))
                 for i, d in enumerate(documents) for _ in range(args.questions)]
    rng.shuffle(questions)
    return warmup, questions


def _run_policy(policy: str, servers: list[Any], router: Any, args: argparse.Namespace
                ) -> dict[str, Any]:
    warmup, questions = _requests(policy, args)
    turn = 0
    holder: dict[int, set[int]] = {}  # document -> engines that have read it

    def pick(prompt: list[int]) -> tuple[int, int]:
        nonlocal turn
        if policy == "kv-aware":
            return router.choose(prompt)
        if policy == "kv-aware, GPU blocks only":
            return router.choose(prompt, frozenset({"GPU"}))
        turn += 1
        return turn % len(servers), -1

    for i, prompt in enumerate(warmup):
        engine, _ = pick(prompt)
        servers[engine].complete(prompt, args.answer_tokens)
        holder.setdefault(i, set()).add(engine)
    time.sleep(EVENTS_SETTLE_S)
    records = []
    for document, prompt in questions:
        engine, held = pick(prompt)
        answer = servers[engine].complete(prompt, args.answer_tokens)
        records.append({"document": document, "engine": engine, "ttft_s": answer.ttft,
                        "to_holder": engine in holder[document], "router_held_blocks": held,
                        "cached_tokens": answer.cached_tokens})
        holder[document].add(engine)
    ttfts = [r["ttft_s"] for r in records]
    return {"records": records, "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "to_holder": sum(r["to_holder"] for r in records), "questions": len(records)}


def run(args: argparse.Namespace) -> int:
    from kvdepot.testbed.checkpoint import SIZES, seeded_checkpoint
    from kvdepot.testbed.kv_router import KVAwareRouter
    from kvdepot.testbed.openai_server import OpenAIServer, api_server_argv, api_server_env
    from kvdepot.testbed.server_process import free_port

    for name in ("documents", "document_tokens", "questions", "question_tokens",
                 "answer_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    config = SIZES[args.model]
    prompt_tokens = args.document_tokens + args.question_tokens + args.answer_tokens
    max_len = -(-prompt_tokens // VLLM_BLOCK) * VLLM_BLOCK
    # vLLM's own cache: one prompt and a block, no more.
    kv_bytes = (max_len + VLLM_BLOCK) * kv_bytes_per_token(config)
    title = (f"kvdepot bench route: 2 vLLM api_servers (CPU, float32, seeded random "
             f"{args.model} Llama), each on its own kvdepot; vLLM KV cache "
             f"{max_len + VLLM_BLOCK} tokens each; {args.documents} documents x "
             f"{args.document_tokens} tokens, {args.questions} questions each; {machine()}")
    print(title, flush=True)
    model_dir = seeded_checkpoint(config)
    log_path = Path(tempfile.gettempdir()) / f"kvdepot-bench-route-vllm-{os.getpid()}.log"
    print(f"  vLLM servers log to {log_path}", flush=True)
    report: dict[str, Any] = {"title": title, "policies": {}}
    with ExitStack() as stack:
        event_urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        router = KVAwareRouter(event_urls, VLLM_BLOCK, bind=True)
        stack.callback(router.close)
        servers = []
        started = time.perf_counter()
        for events_url in event_urls:
            url, _ = stack.enter_context(server_process(args.chunk_size, "4GiB"))
            port = free_port()
            argv = api_server_argv(model_dir, port, url, kv_bytes, max_len,
                                   kv_events_to=events_url)
            servers.append(stack.enter_context(
                OpenAIServer(argv, api_server_env(), port, log_path)))
        print(f"  2 nodes up in {time.perf_counter() - started:.0f} s", flush=True)
        for server in servers:  # first-call overheads
            server.complete(random_tokens(random.Random("warm-up"), 256), 2)
        for policy in POLICIES:
            result = _run_policy(policy, servers, router, args)
            report["policies"][policy] = result
            print(f"  {policy}: mean TTFT {result['ttft_mean_ms']:.0f} ms, p50 "
                  f"{result['ttft_p50_ms']:.0f} ms; {result['to_holder']} of "
                  f"{result['questions']} questions sent to an engine that had read the "
                  "document", flush=True)
        report["router_blocks"] = {
            f"engine {e}": {m: router.index.blocks(e, m) for m in ("GPU", "CPU", "STORAGE")}
            for e in range(2)}
    rr, gpu_only, aware = (report["policies"][p]["ttft_mean_ms"] for p in POLICIES)
    report["kv_aware_over_round_robin"] = aware / rr
    report["kv_aware_over_gpu_only"] = aware / gpu_only
    print(f"\n  KV-aware mean TTFT / round-robin: {aware / rr:.2f} "
          f"({aware:.0f} ms against {rr:.0f} ms); / the router seeing GPU blocks only: "
          f"{aware / gpu_only:.2f} ({gpu_only:.0f} ms)")
    print(f"  blocks the router sees per engine, by medium: {report['router_blocks']}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0
