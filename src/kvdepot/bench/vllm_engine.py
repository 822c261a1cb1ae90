"""A real vLLM engine on CPU with random weights, for the demo and `bench e2e`.

No model hub is reachable, so the model is a `config.json` for a small Llama and vLLM
loads dummy weights (deterministic for a fixed seed) with no tokenizer; prompts are
token ids. The geometry is the one `bench e2e` is specified for: 8 layers, hidden
1024, 4 KV heads x 64, vocab 4096.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

VOCAB = 4096

LLAMA_CONFIG: dict[str, Any] = {
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
    # float32: CPUs without AVX-512 (like the 2-core machines here) emulate bf16 slowly.
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
}


def write_model(folder: Path, config: dict[str, Any] = LLAMA_CONFIG) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def make_engine(model_dir: str, url: str | None, max_len: int) -> Any:
    """An `LLM` using KVDepotConnector at `url`, or no connector at all for url=None."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None if url is None else KVTransferConfig(
        kv_connector="KVDepotConnector",
        kv_connector_module_path="kvdepot.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"kvdepot.url": url},
    )
    return LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, seed=0,
               max_model_len=max_len, max_num_batched_tokens=max_len, enforce_eager=True,
               kv_transfer_config=transfer)


def shutdown_engine(llm: Any) -> None:
    """Stop the engine's processes now (the LLM object has no public close)."""
    llm.llm_engine.engine_core.shutdown()


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """Token ids clear of the special ids and below the vocabulary size."""
    return [rng.randrange(10, VOCAB - 10) for _ in range(n)]


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


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[Any]]:
    """Greedy generation; returns (wall seconds, outputs)."""
    from vllm import SamplingParams, TokensPrompt

    start = time.perf_counter()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False,
                       ignore_eos=True),
        use_tqdm=False)
    return time.perf_counter() - start, outputs
