"""vLLM integration: the KV connector and the seed-compatible engine adapters.

`KVDepotConnector` is resolved lazily so that importing the adapters
(`kvdepot.integrations.vllm.mp_adapter`) does not import vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVDepotConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVDepotConnector":
        from kvdepot.integrations.vllm.connector import KVDepotConnector

        return KVDepotConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
