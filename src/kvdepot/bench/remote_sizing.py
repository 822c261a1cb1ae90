"""Whether a shared-tier hit beats recomputing, for models people run: an 8k-token prefix
read at a measured rate, beside published prefill rates.

KV per token (bf16, full attention): 2 (K and V) x layers x KV heads x head dim x 2 bytes.
The prefill rates are published figures, each with its source; none is for batch 1 at 8k
tokens on TP-8, which no source found gave (docs/shared-tier.md says how they were read).
"""

from __future__ import annotations

from typing import NamedTuple

PREFIX_TOKENS = 8192


class Reference(NamedTuple):
    model: str
    kv_bytes_per_token: int
    gpus: str
    prefill_tokens_per_s: float
    source: str


REFERENCES = (
    Reference("Llama-3.1-8B", 2 * 32 * 8 * 128 * 2, "1x H100, FP8", 55_000,
              "TensorRT-LLM performance overview: 3,450 output tokens/s at 2048/128 on one "
              "H100 (FP8), x 2048/128 input tokens per output token; batched, decode counted "
              "as prefill, so a lower bound"),
    Reference("Llama-3.1-70B", 2 * 80 * 8 * 128 * 2, "2x H100, FP8, TP-2", 12_300,
              "NVIDIA NIM LLM benchmarking (Llama-3.3-70B, same architecture): TTFT 406.77 ms "
              "for 5,000 input tokens at concurrency 1 on 2x H100 FP8 TP-2"),
)


def print_sizing(read_bytes_per_s: float) -> None:
    """The time to read each reference model's 8k-token prefix at `read_bytes_per_s`
    beside the time its published prefill rate computes it."""
    print(f"  an {PREFIX_TOKENS}-token prefix at the promotion rate measured above "
          f"({read_bytes_per_s / 1e9:.2f} GB/s), beside published prefill rates:")
    for ref in REFERENCES:
        nbytes = ref.kv_bytes_per_token * PREFIX_TOKENS
        load = nbytes / read_bytes_per_s
        compute = PREFIX_TOKENS / ref.prefill_tokens_per_s
        verdict = "the shared tier wins" if load < compute else "recomputing wins"
        print(f"    {ref.model:<14} {nbytes / 1e9:5.2f} GB: read {load * 1e3:6.0f} ms, "
              f"computed {compute * 1e3:5.0f} ms on {ref.gpus} ({verdict}; break-even at "
              f"{nbytes / compute / 1e9:.1f} GB/s)")
    for ref in REFERENCES:
        print(f"      {ref.model}: {ref.source}")
