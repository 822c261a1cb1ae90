"""`KVDepotConnector.kv_cache_access`, the question vLLM 0.34 asks before it allocates the
KV cache: EXPORTS_FD on CUDA (the extensible cache, exportable as POSIX descriptors),
LEGACY_IPC when the operator asks for it, IN_PROCESS elsewhere; older vLLM has no
`KVCacheAccess` and never asks. vLLM 0.34's flag is stood in for where the installed vLLM
is older (the names are vLLM's)."""

from __future__ import annotations

import enum

import pytest

pytest.importorskip("vllm")

import vllm.config.kv_transfer as kv_transfer
import vllm.platforms

from kvdepot.integrations.vllm.connector import (
    KV_CACHE_ACCESS_VARIABLE,
    KVDepotConnector,
)

pytestmark = pytest.mark.vllm


class KVCacheAccess(enum.IntFlag):
    IN_PROCESS = 0
    REGISTERS = enum.auto()
    EXPORTS_FD = enum.auto()
    EXPORTS_FABRIC = enum.auto()
    LEGACY_IPC = enum.auto()


@pytest.fixture
def vllm_034(monkeypatch: pytest.MonkeyPatch) -> type[KVCacheAccess]:
    flag = getattr(kv_transfer, "KVCacheAccess", None) or KVCacheAccess
    monkeypatch.setattr(kv_transfer, "KVCacheAccess", flag, raising=False)
    monkeypatch.delenv(KV_CACHE_ACCESS_VARIABLE, raising=False)
    return flag


def on_cuda(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    monkeypatch.setattr(type(vllm.platforms.current_platform), "is_cuda",
                        lambda self: cuda)


def test_cuda_asks_for_descriptors(monkeypatch, vllm_034) -> None:
    on_cuda(monkeypatch, True)
    assert KVDepotConnector.kv_cache_access(None) == vllm_034.EXPORTS_FD


def test_the_operator_may_ask_for_legacy_ipc(monkeypatch, vllm_034) -> None:
    on_cuda(monkeypatch, True)
    monkeypatch.setenv(KV_CACHE_ACCESS_VARIABLE, "legacy_ipc")
    assert KVDepotConnector.kv_cache_access(None) == vllm_034.LEGACY_IPC
    monkeypatch.setenv(KV_CACHE_ACCESS_VARIABLE, "ipc")
    with pytest.raises(ValueError, match="must be fd or legacy_ipc, not 'ipc'"):
        KVDepotConnector.kv_cache_access(None)


def test_elsewhere_the_cache_is_not_exported(monkeypatch, vllm_034) -> None:
    on_cuda(monkeypatch, False)
    assert KVDepotConnector.kv_cache_access(None) == vllm_034.IN_PROCESS


def test_older_vllm_is_not_asked(monkeypatch) -> None:
    monkeypatch.delattr(kv_transfer, "KVCacheAccess", raising=False)
    assert KVDepotConnector.kv_cache_access(None) is None
