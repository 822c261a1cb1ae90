"""`kvdepot demo`: a real vLLM engine (CPU) serving a workload through kvdepot.

The workload repeats long prefixes the way real traffic does: questions about the same
documents, and a multi-turn chat whose every turn resends the whole history. Before
each request vLLM's own prefix cache is emptied, as it would be on a busy engine that
had to evict those blocks, so every reuse has to come from kvdepot or be recomputed.
The model is a seeded random checkpoint whose output depends on the prompt, so the
correctness check at the end (with its control, `correctness.py`) can fail.

Output: one line per phase while it runs; then per request its tokens, the tokens
loaded from kvdepot and the time to first token, the medians and hit rate, and the
correctness check with its verdict.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdepot.client.admin import AdminClient
from kvdepot.options import DEFAULTS
from kvdepot.testbed.checkpoint import SIZES, seeded_checkpoint
from kvdepot.testbed.correctness import check_correctness, engine_ask, probe_length
from kvdepot.testbed.measurement import server_process
from kvdepot.testbed.vllm_engine import (
    Completion,
    make_engine,
    random_tokens,
    request_counting_loads,
    shutdown_engine,
)

CHUNK = DEFAULTS.chunk_size
DEMO_MODEL = SIZES["medium"]
PHASES = 5


@dataclass
class Row:
    name: str
    prompt_tokens: int
    loaded_tokens: int
    ttft_s: float


class Runner:
    """Sends the workload's requests and records each one for the table."""

    def __init__(self, llm: Any, admin: AdminClient) -> None:
        self.llm = llm
        self.admin = admin
        self.rows: list[Row] = []

    def ask(self, name: str, prompt: list[int]) -> Completion:
        """One request, first token only, after emptying vLLM's prefix cache."""
        elapsed, completion, loaded = request_counting_loads(self.llm, self.admin, prompt)
        self.rows.append(Row(name, len(prompt), loaded, elapsed))
        return completion


def run_workload(runner: Runner, rng: random.Random, docs: int, doc_tokens: int, turns: int
                 ) -> None:
    # Documents: the first question computes the document; later ones reuse it.
    for d in range(docs):
        doc = random_tokens(rng, doc_tokens)
        for q in range(3):
            runner.ask(f"doc {d + 1}, question {q + 1}", doc + random_tokens(rng, 40))
    # A chat: every turn resends the whole history plus a new message.
    history = random_tokens(rng, 1024)  # the system prompt
    for t in range(turns):
        history += random_tokens(rng, 200)
        reply = runner.ask(f"chat turn {t + 1}", list(history))
        history += reply.token_ids + random_tokens(rng, 60)


def table(rows: list[Row]) -> list[str]:
    lines = [f"  {'request':<28}{'tokens':>8}{'loaded':>10}{'TTFT ms':>12}"]
    lines += [f"  {r.name:<28}{r.prompt_tokens:>8}{r.loaded_tokens:>10}{r.ttft_s * 1e3:>12.0f}"
              for r in rows]
    return lines


def summary(rows: list[Row]) -> list[str]:
    cold = [r.ttft_s for r in rows if r.loaded_tokens == 0 and r.prompt_tokens > CHUNK]
    hit = [r.ttft_s for r in rows if r.loaded_tokens > 0]
    prompt = sum(r.prompt_tokens for r in rows)
    loaded = sum(r.loaded_tokens for r in rows)
    lines = [f"  {label:<19}{len(times):>3}, median TTFT {statistics.median(times) * 1e3:8.0f} ms"
             for label, times in (("cold requests:", cold), ("kvdepot hits:", hit)) if times]
    if cold and hit:
        lines.append(f"  speed-up on hits:  "
                     f"{statistics.median(cold) / statistics.median(hit):.1f}x")
    lines.append(f"  hit rate:          {loaded / prompt:.0%} of all prompt tokens loaded from "
                 f"kvdepot ({loaded} of {prompt})")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--docs", type=int, default=2, help="documents (3 questions each)")
    parser.add_argument("--doc-tokens", type=int, default=3000)
    parser.add_argument("--turns", type=int, default=4, help="turns of the chat")


class Progress:
    """One line per phase, with the seconds it took."""

    def __init__(self) -> None:
        self.phase = 0
        self.started = time.monotonic()

    def __call__(self, text: str) -> None:
        self.phase += 1
        now = time.monotonic()
        print(f"[{self.phase}/{PHASES}] {text} ({now - self.started:.0f} s)", flush=True)
        self.started = now


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    progress = Progress()
    rng = random.Random(7)
    with server_process(CHUNK, "2GiB") as (url, _), AdminClient(url) as admin:
        progress(f"kvdepot serve is up at {url} (chunks of {CHUNK} tokens; it logs warnings "
                 "only)")
        model = seeded_checkpoint(DEMO_MODEL)
        progress(f"model: a {DEMO_MODEL['num_hidden_layers']}-layer Llama with seeded random "
                 f"weights, in {model}")
        vllm_log = Path(tempfile.gettempdir()) / f"kvdepot-demo-vllm-{os.getpid()}.log"
        llm = make_engine(model, url, 8192, log_path=vllm_log)
        progress(f"vLLM engine started with KVDepotConnector (CPU, float32; its warnings go to "
                 f"{vllm_log})")
        try:
            runner = Runner(llm, admin)
            run_workload(runner, rng, args.docs, args.doc_tokens, args.turns)
            progress(f"workload: {len(runner.rows)} requests, vLLM's prefix cache emptied "
                     "before each")
            length = probe_length(CHUNK, 4)
            report = check_correctness(engine_ask(llm, admin),
                                       random_tokens(rng, length), random_tokens(rng, length),
                                       CHUNK)
            progress("correctness check: one prompt cold, as a vLLM hit, as a kvdepot hit, "
                     "and a control prompt")
        finally:
            shutdown_engine(llm)  # else its processes keep the demo from exiting on an error

    print()
    print("\n".join([*table(runner.rows), "", *summary(runner.rows), "", *report.lines()]))
    return 1 if report.failures() else 0
