"""`kvdepot demo`: a real vLLM engine (CPU, dummy weights) serving through kvdepot.

The workload repeats long prefixes the way real traffic does: questions about the same
documents, and a multi-turn chat whose every turn resends the whole history. Before
each request vLLM's own prefix cache is emptied, as it would be on a busy engine that
had to evict those blocks, so every reuse has to come from kvdepot or be recomputed.
The table shows per request its tokens, the tokens loaded from kvdepot and the time to
first token; then cold vs hit medians and the hit rate, and a check that a cached
answer is token-for-token the cold one.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdepot.bench.harness import server_process
from kvdepot.bench.vllm_engine import (
    LLAMA_CONFIG,
    evict_local_cache,
    generate,
    make_engine,
    random_tokens,
    shutdown_engine,
    write_model,
)
from kvdepot.client.admin import AdminClient

CHUNK = 256
# Half the depth and width of the benchmark model, so cold requests take seconds, not
# minutes, on two cores; reuse still saves nearly all of their time.
DEMO_MODEL = {**LLAMA_CONFIG, "num_hidden_layers": 4, "hidden_size": 512,
              "intermediate_size": 1408, "num_attention_heads": 8}


@dataclass
class Row:
    name: str
    prompt_tokens: int
    loaded_tokens: int
    ttft_s: float
    output: list[int]


class Runner:
    def __init__(self, llm: Any, url: str) -> None:
        self.llm = llm
        self.admin = AdminClient(url)
        self.rows: list[Row] = []

    def ask(self, name: str, prompt: list[int], max_tokens: int = 1) -> Row:
        evict_local_cache(self.llm)
        before = self.admin.stats()["retrieved_chunks"]
        elapsed, out = generate(self.llm, [prompt], max_tokens)
        loaded = int(self.admin.stats()["retrieved_chunks"] - before) * CHUNK
        row = Row(name, len(prompt), loaded, elapsed, list(out[0].outputs[0].token_ids))
        self.rows.append(row)
        print(f"  {row.name:<28}{row.prompt_tokens:>8}{row.loaded_tokens:>10}"
              f"{row.ttft_s * 1e3:>12.0f}", flush=True)
        return row


def run_workload(runner: Runner, docs: int, doc_tokens: int, turns: int) -> tuple[bool, int]:
    rng = random.Random(7)
    print(f"  {'request':<28}{'tokens':>8}{'loaded':>10}{'TTFT ms':>12}")
    # Documents: the first question computes the document; later ones reuse it.
    for d in range(docs):
        doc = random_tokens(rng, doc_tokens)
        for q in range(3):
            runner.ask(f"doc {d + 1}, question {q + 1}", doc + random_tokens(rng, 40))
    # A chat: every turn resends the whole history plus a new message.
    history = random_tokens(rng, 1024)  # the system prompt
    for t in range(turns):
        history += random_tokens(rng, 200)
        reply = runner.ask(f"chat turn {t + 1}", list(history), max_tokens=1)
        history += reply.output + random_tokens(rng, 60)
    # Correctness: the same prompt cold (after CLEAR) and from kvdepot, 16 greedy tokens.
    probe = random_tokens(rng, 4 * CHUNK + 17)
    runner.admin.clear()
    cold = runner.ask("check: cold", probe, max_tokens=16)
    hit = runner.ask("check: from kvdepot", probe, max_tokens=16)
    return cold.output == hit.output and hit.loaded_tokens > 0, hit.loaded_tokens


def summarize(rows: list[Row]) -> None:
    cold = [r.ttft_s for r in rows if r.loaded_tokens == 0 and r.prompt_tokens > CHUNK]
    hit = [r.ttft_s for r in rows if r.loaded_tokens > 0]
    prompt = sum(r.prompt_tokens for r in rows)
    loaded = sum(r.loaded_tokens for r in rows)
    print()
    for label, times in (("cold requests:", cold), ("kvdepot hits:", hit)):
        if times:
            print(f"  {label:<19}{len(times):>3}, median TTFT "
                  f"{statistics.median(times) * 1e3:8.0f} ms")
    if cold and hit:
        print(f"  speed-up on hits:  {statistics.median(cold) / statistics.median(hit):.1f}x")
    print(f"  hit rate:          {loaded / prompt:.0%} of all prompt tokens loaded from kvdepot "
          f"({loaded} of {prompt})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--docs", type=int, default=2, help="documents (3 questions each)")
    parser.add_argument("--doc-tokens", type=int, default=3000)
    parser.add_argument("--turns", type=int, default=4, help="turns of the chat")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    with tempfile.TemporaryDirectory() as tmp, server_process(CHUNK, "2GiB") as (url, _):
        print(f"kvdepot serve is up at {url}; starting vLLM (CPU, dummy weights, "
              f"{DEMO_MODEL['num_hidden_layers']} layers)...", flush=True)
        llm = make_engine(write_model(Path(tmp) / "model", DEMO_MODEL), url, 8192)
        runner = Runner(llm, url)
        print()
        identical, loaded = run_workload(runner, args.docs, args.doc_tokens, args.turns)
        shutdown_engine(llm)
        summarize(runner.rows)
        print(f"  correctness:       16 greedy tokens after loading {loaded} tokens from kvdepot "
              f"{'are identical to' if identical else 'DIFFER FROM'} the cold run's")
        runner.admin.close()
        return 0 if identical else 1
