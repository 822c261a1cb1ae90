"""The connector's refusal of KV memory no other process can map (sleep mode on a GPU
before vLLM 0.34): the rule alone, with the .venv's vLLM (0.32, no `kv_cache_access`).
The engine-level check runs on the GPU machine (tests/gpu/test_vllm_gpu.py)."""

from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")

from vllm.platforms import current_platform  # noqa: E402

from kvdepot.integrations.vllm.connector import unexportable_kv_memory  # noqa: E402


def config(sleep_mode: bool) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=sleep_mode))


def test_sleep_mode_on_a_gpu_before_kv_cache_access_is_refused_and_says_why(monkeypatch
                                                                             ) -> None:
    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self: True)
    reason = unexportable_kv_memory(config(sleep_mode=True))
    assert reason is not None and "CuMemAllocator" in reason and "without kvdepot" in reason
    assert unexportable_kv_memory(config(sleep_mode=False)) is None


def test_sleep_mode_on_a_cpu_is_served() -> None:
    assert not current_platform.is_cuda_alike()
    assert unexportable_kv_memory(config(sleep_mode=True)) is None
