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
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdepot.bench.harness import server_process
from kvdepot.client.admin import AdminClient

CHUNK = 256
VOCAB = 4096

# Big enough that prefill dominates a cold request on CPU, small enough to start fast.
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_hidden_layers": 8,
    "vocab_size": VOCAB,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
}


def write_model(folder: Path, config: dict[str, Any]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def make_engine(model_dir: str, url: str, max_len: int) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        seed=0,
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        enforce_eager=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVDepotConnector",
            kv_connector_module_path="kvdepot.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"kvdepot.url": url},
        ),
    )


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB - 10) for _ in range(n)]


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

    def evict_local_cache(self, timeout: float = 60.0) -> None:
        """Empty vLLM's own prefix cache, as pressure on a busy engine would.

        vLLM refuses while the previous request's blocks are still held, which they are
        until kvdepot has copied them (the store runs after the request's last step).
        """
        deadline = time.monotonic() + timeout
        while not self.llm.reset_prefix_cache():
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM kept blocks of finished requests for a minute; "
                                   "their stores to kvdepot never completed")
            time.sleep(0.05)

    def ask(self, name: str, prompt: list[int], max_tokens: int = 1) -> Row:
        from vllm import SamplingParams, TokensPrompt

        self.evict_local_cache()
        before = self.admin.stats()["retrieved_chunks"]
        start = time.perf_counter()
        out = self.llm.generate(
            [TokensPrompt(prompt_token_ids=prompt)],
            SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False,
                           ignore_eos=True),
            use_tqdm=False)
        elapsed = time.perf_counter() - start
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
        doc = tokens(rng, doc_tokens)
        for q in range(3):
            runner.ask(f"doc {d + 1}, question {q + 1}", doc + tokens(rng, 40))
    # A chat: every turn resends the whole history plus a new message.
    history = tokens(rng, 1024)  # the system prompt
    for t in range(turns):
        history += tokens(rng, 200)
        reply = runner.ask(f"chat turn {t + 1}", list(history), max_tokens=1)
        history += reply.output + tokens(rng, 60)
    # Correctness: the same prompt cold (after CLEAR) and from kvdepot, 16 greedy tokens.
    probe = tokens(rng, 4 * CHUNK + 17)
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
        print(f"kvdepot serve is up at {url}; starting vLLM (CPU, dummy weights, 8 layers)...",
              flush=True)
        llm = make_engine(write_model(Path(tmp) / "model", MODEL_CONFIG), url, 8192)
        runner = Runner(llm, url)
        print()
        identical, loaded = run_workload(runner, args.docs, args.doc_tokens, args.turns)
        summarize(runner.rows)
        print(f"  correctness:       16 greedy tokens after loading {loaded} tokens from kvdepot "
              f"{'are identical to' if identical else 'DIFFER FROM'} the cold run's")
        runner.admin.close()
        return 0 if identical else 1
