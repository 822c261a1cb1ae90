"""A real vLLM engine on CPU for the demo and `bench e2e`.

The model is a seeded random checkpoint (`checkpoint.py`) with no tokenizer, so prompts
are token ids. Generation is greedy; each generated token can carry its top logprobs,
which the correctness check compares.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdepot.testbed.checkpoint import FIRST_ORDINARY_TOKEN, VOCAB

if TYPE_CHECKING:
    from kvdepot.client.admin import AdminClient


@dataclass
class Completion:
    token_ids: list[int]
    # Per generated token, the top logprobs in rank order (empty unless asked for).
    top_logprobs: list[list[float]]


def quiet_vllm_logging() -> None:
    """Keep vLLM's INFO lines out of the output; its errors still show.

    Must run before vLLM is imported: vLLM reads these once, and its engine processes
    inherit them from the environment.
    """
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


@contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Send this process's stderr to `path` while the block runs.

    The engine processes vLLM starts meanwhile keep it for good: their warnings and
    progress bars, which no logging level silences (some are printed before vLLM
    configures its logging), land in the file.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def make_engine(model_dir: Path, url: str | None, max_len: int, log_path: Path | None = None,
                **options: Any) -> Any:
    """An `LLM` using KVDepotConnector at `url`, or no connector at all for url=None.

    With `log_path`, vLLM logs errors only and its engine processes write their stderr
    there. `options`: `block_size` (vLLM's; None: its default) and `connector`, the
    connector's options as {name: value} ("kvdepot.<name>" keys).
    """
    if log_path is None:
        return _make_engine(model_dir, url, max_len, **options)
    quiet_vllm_logging()
    with stderr_to(log_path):
        return _make_engine(model_dir, url, max_len, **options)


def kv_transfer_config(url: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` for KVDepotConnector at `url`, its `options` as
    "kvdepot.<name>" keys (for the `LLM` class and for `vllm serve`'s JSON alike)."""
    return {"kv_connector": "KVDepotConnector",
            "kv_connector_module_path": "kvdepot.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "kvdepot.url": url, **{f"kvdepot.{k}": v for k, v in (options or {}).items()}}}


def lmcache_transfer_config(port: int, host: str = "127.0.0.1") -> dict[str, Any]:
    """vLLM's `kv_transfer_config` for LMCache's multiprocess server at `host:port`
    through vLLM's in-tree `LMCacheMPConnector` name (vLLM 0.26 resolves it to the class
    the lmcache package ships, or to its own copy if that does not import).

    The connector builds its ZeroMQ endpoint as "<lmcache.mp.host>:<lmcache.mp.port>", so
    the host carries the scheme. Its chunk size is the server's (`--chunk-size`)."""
    return {"kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{host}",
                                          "lmcache.mp.port": port}}


def _make_engine(model_dir: Path, url: str | None, max_len: int, block_size: int | None = None,
                 connector: dict[str, Any] | None = None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None if url is None else KVTransferConfig(**kv_transfer_config(url, connector))
    sizes = {} if block_size is None else {"block_size": block_size}
    # dtype is explicit: vLLM on CPU would otherwise run bfloat16 whatever the config
    # says, and float32 keeps a cold run and a cache hit comparable to rounding noise.
    return LLM(model=str(model_dir), skip_tokenizer_init=True, seed=0, dtype="float32",
               max_model_len=max_len, max_num_batched_tokens=max_len, enforce_eager=True,
               use_tqdm_on_load=False, kv_transfer_config=transfer, **sizes)


def shutdown_engine(llm: Any) -> None:
    """Stop the engine's processes now (the LLM object has no public close)."""
    llm.llm_engine.engine_core.shutdown()


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """Token ids clear of the special ids and below the vocabulary size."""
    return [rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB - FIRST_ORDINARY_TOKEN) for _ in range(n)]


def evict_local_cache(llm: Any, timeout: float = 60.0) -> None:
    """Empty vLLM's own prefix cache, as pressure on a busy engine would.

    vLLM refuses while a finished request's blocks are still held, which they are until
    kvdepot has copied them (the store completes after the request's last step).
    """
    deadline = time.monotonic() + timeout
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM kept blocks of finished requests for a minute; their "
                               "stores to kvdepot never completed")
        time.sleep(0.05)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int, top_logprobs: int = 0
             ) -> tuple[float, list[Completion]]:
    """Greedy generation; returns (wall seconds, one completion per prompt)."""
    from vllm import SamplingParams, TokensPrompt

    start = time.perf_counter()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False,
                       ignore_eos=True, logprobs=top_logprobs or None),
        use_tqdm=False)
    elapsed = time.perf_counter() - start
    completions = []
    for output in outputs:
        sample = output.outputs[0]
        ranked = [sorted(step.values(), key=lambda lp: lp.rank)[:top_logprobs]
                  for step in sample.logprobs or []]
        completions.append(Completion(list(sample.token_ids),
                                      [[lp.logprob for lp in step] for step in ranked]))
    return elapsed, completions


def request_counting_loads(llm: Any, admin: AdminClient, prompt: list[int],
                           max_tokens: int = 1, evict_first: bool = True,
                           top_logprobs: int = 0) -> tuple[float, Completion, int]:
    """One greedy request: (wall seconds, completion, tokens it loaded from kvdepot).

    With `evict_first`, vLLM's prefix cache is emptied before, so whatever the request
    reuses comes from kvdepot. Nothing else may use the server meanwhile.
    """
    if evict_first:
        evict_local_cache(llm)
    before = admin.stats()["retrieved_tokens"]
    elapsed, out = generate(llm, [prompt], max_tokens, top_logprobs)
    loaded = int(admin.stats()["retrieved_tokens"] - before)
    return elapsed, out[0], loaded


def throughput(llm: Any, prompts: int, prompt_tokens: int, output_tokens: int, repeats: int,
               seed: int) -> list[float]:
    """Prompt and generated tokens per second, one figure per batch of `prompts` unique
    prompts (a short request first, so no batch pays first-call costs)."""
    rng = random.Random(seed)
    generate(llm, [random_tokens(rng, 256)], 1)
    rates = []
    for _ in range(repeats):
        batch = [random_tokens(rng, prompt_tokens) for _ in range(prompts)]
        elapsed, _ = generate(llm, batch, output_tokens)
        rates.append(prompts * (prompt_tokens + output_tokens) / elapsed)
    return rates
