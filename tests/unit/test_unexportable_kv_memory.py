"""The connector's rule for KV memory no other process can map as allocated (sleep mode on
a GPU before vLLM 0.34): served where the worker can move it onto exportable memory
(`cumem_sleep`), refused with the reason where it cannot. The rule alone, with the .venv's
vLLM (0.32, no `kv_cache_access`); the move itself and a sleep-mode engine's hits before
and after sleeping run on the GPU machine (tests/gpu/test_sleep_mode_gpu.py,
tests/gpu/test_vllm_gpu.py)."""

from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")

from vllm.platforms import current_platform  # noqa: E402

from kvdepot.integrations.vllm import cumem_sleep  # noqa: E402
from kvdepot.integrations.vllm.connector import (  # noqa: E402
    sleep_memory_to_make_exportable,
    unexportable_kv_memory,
)


def config(sleep_mode: bool) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=sleep_mode))


def test_sleep_mode_on_a_gpu_is_made_exportable_where_the_allocator_allows(monkeypatch
                                                                          ) -> None:
    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self: True)
    monkeypatch.setattr(cumem_sleep, "can_make_exportable", lambda: True)
    assert sleep_memory_to_make_exportable(config(sleep_mode=True))
    assert unexportable_kv_memory(config(sleep_mode=True)) is None
    assert not sleep_memory_to_make_exportable(config(sleep_mode=False))


def test_sleep_mode_on_a_gpu_whose_allocator_cannot_be_moved_is_refused_and_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self: True)
    # The .venv's vLLM is a CPU build: its CuMem allocator is not available.
    assert not cumem_sleep.can_make_exportable()
    reason = unexportable_kv_memory(config(sleep_mode=True))
    assert reason is not None and "sleep mode" in reason and "without kvdepot" in reason
    assert unexportable_kv_memory(config(sleep_mode=False)) is None


def test_sleep_mode_on_a_cpu_is_served() -> None:
    assert not current_platform.is_cuda_alike()
    assert not sleep_memory_to_make_exportable(config(sleep_mode=True))
    assert unexportable_kv_memory(config(sleep_mode=True)) is None
