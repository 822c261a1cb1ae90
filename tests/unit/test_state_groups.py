"""Which hybrid models with recurrent layers the connector serves (issue 44), decided
from vLLM's own KV cache group classes (those of the vLLM installed for the tests)."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

from kvdepot.integrations.vllm.connector import state_groups_of, unservable_groups

BLOCK = 640


def _mamba(mode: str = "align", speculative: int = 0) -> KVCacheGroupSpec:
    spec = MambaSpec(block_size=BLOCK, shapes=((3, 1024), (4, 128, 128)),
                     dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode=mode,
                     num_speculative_blocks=speculative)
    return KVCacheGroupSpec(["model.layers.0.linear_attn"], spec)


def _attention(block_size: int = BLOCK) -> KVCacheGroupSpec:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16)
    return KVCacheGroupSpec(["model.layers.1.self_attn.attn"], spec)


def test_states_kept_at_block_boundaries_are_served() -> None:
    groups = [_mamba(), _attention()]
    assert state_groups_of(groups) == (0,)
    assert unservable_groups(groups, BLOCK) is None


@pytest.mark.parametrize("groups, reason", [
    ([_mamba("all"), _attention()], "mamba_cache_mode 'all'"),
    ([_mamba("none"), _attention()], "mamba_cache_mode 'none'"),
    ([_mamba(speculative=1), _attention()], "speculative blocks"),
    ([_mamba()], "no group holds attention KV"),
    ([_mamba(), _attention(block_size=16)], "blocks of 16 tokens"),
])
def test_other_recurrent_models_run_without_kvdepot(groups: list[KVCacheGroupSpec],
                                                    reason: str) -> None:
    refusal = unservable_groups(groups, BLOCK)
    assert refusal is not None and reason in refusal
    assert "this engine runs without kvdepot" in refusal


def test_a_group_missing_from_the_registered_caches_is_refused() -> None:
    from kvdepot.integrations.vllm.worker_side import grouped_layers

    caches = {"model.layers.1.self_attn.attn": torch.zeros(4, 2, BLOCK, 128)}
    groups = {"model.layers.0.linear_attn": 0, "model.layers.1.self_attn.attn": 1}
    with pytest.raises(ValueError, match=r"group\(s\) \[0\] of vLLM's have no layer"):
        grouped_layers(caches, groups)
    caches["model.layers.0.linear_attn"] = torch.zeros(4, 1, 1, 64, dtype=torch.int8)
    assert list(grouped_layers(caches, groups)) == list(caches)
