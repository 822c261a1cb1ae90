"""Gemma 3 (sliding-window layers beside global ones) in a real vLLM engine (issue 44).

Gemma3ForCausalLM with its own weight names, norms and query scaling, seeded weights;
its first layer attends to a 256-token window, its second to everything. vLLM's hybrid
KV cache manager gives it two KV cache groups (SlidingWindowSpec, FullAttentionSpec);
every chunk carries both, and a hit must be vLLM's own hit bit for bit.
"""

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BLOCK, CHUNK, DepotServer, Engine, tokens
from family_checks import assert_close, assert_differs, cold_run, stored_then_hit

from kvdepot.client.admin_api import AdminAPI
from kvdepot.testbed.family_checkpoint import family_checkpoint
from kvdepot.testbed.server_process import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# Gemma 3's public architecture, scaled down: 2 layers of 4 query heads and 2 KV heads of
# 64, q/k norms, a local layer then a global one (Gemma 3 has five local per global).
GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "query_pre_attn_scalar": 64, "vocab_size": 4096, "max_position_embeddings": 4096,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2 * BLOCK,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    """The server's admin API and Prometheus ports."""
    return free_port(), free_port()


@pytest.fixture(scope="module")
def server(log_dir: Path, ports: tuple[int, int]) -> Iterator[DepotServer]:
    admin, metrics = ports
    depot = DepotServer(log_dir, extra=("--admin-port", str(admin),
                                        "--metrics-port", str(metrics)))
    depot.start()
    yield depot
    depot.kill()


@pytest.fixture(scope="module")
def engine(server: DepotServer, log_dir: Path) -> Iterator[Engine]:
    eng = Engine(family_checkpoint(GEMMA3_CONFIG), server.url, log_dir / "engine-gemma.log",
                 llm_kwargs={"disable_hybrid_kv_cache_manager": False})
    yield eng
    eng.close()


def test_gemma3_hit_is_vllms_own_hit(engine: Engine, server: DepotServer) -> None:
    assert isinstance(server.output, Path)
    assert "in 2 KV cache group(s)" in server.output.read_text()
    prompt = tokens(4400, 4 * CHUNK + 70)
    reference = cold_run(engine, prompt)
    # Controls: a token long before the window reaches the output through the global
    # layer only, one inside it through both; either change must show.
    assert_differs(cold_run(engine, [prompt[0] + 1, *prompt[1:]]), reference)
    assert_differs(cold_run(engine, [*prompt[:-5], prompt[-5] + 1, *prompt[-4:]]), reference)

    own, hit, counters = stored_then_hit(engine, server, prompt)
    assert counters["retrieved_chunks"] == 4
    assert counters["retrieve_errors"] == 0
    assert hit == own  # token ids and top-5 log-probabilities, bit for bit
    assert_close(hit, reference)


def test_each_groups_cost_per_token_in_status_and_prometheus(
    engine: Engine, server: DepotServer, ports: tuple[int, int]
) -> None:
    # One layer per group, 2 KV heads of 64, K and V, float32: 1 KiB a token each.
    admin, metrics = ports
    (registered,) = AdminAPI(f"http://127.0.0.1:{admin}", url=server.url).status()["engines"]
    assert registered["layout"]["groups"] == [
        {"group": 0, "layers": 1, "bytes_per_token": 1024.0},
        {"group": 1, "layers": 1, "bytes_per_token": 1024.0}]
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.findall(r'^kvdepot_kv_group_bytes_per_token\{.*group="(\d)".*\} (\S+)$', text,
                       re.MULTILINE)
    assert sorted(found) == [("0", "1024.0"), ("1", "1024.0")]
