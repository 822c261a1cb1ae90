"""The seed-compatible engine adapters: LMCache multiprocess-mode names over kvdepot.

An engine integration written against LMCache's `vllm_multi_process_adapter` works
unchanged with these names. Every compatibility shim lives here, at the edge: the
clients in `kvdepot.client` are the core, and kvdepot's own connector uses them directly.
"""

from __future__ import annotations

from kvdepot.client.engine_types import BlockAllocationRecord, LoadStoreOp, ParallelStrategy
from kvdepot.client.heartbeat import HeartbeatThread
from kvdepot.client.scheduler import SchedulerClient
from kvdepot.client.worker import WorkerClient
from kvdepot.options import DEFAULTS

DEFAULT_MQ_TIMEOUT = DEFAULTS.mq_timeout
DEFAULT_HEARTBEAT_INTERVAL = DEFAULTS.heartbeat_interval

StoreResult = bool
RetrieveResult = bool
LookupResult = int


class LMCacheMPSchedulerAdapter(SchedulerClient):
    """Scheduler-side adapter (lookups, lock release, sessions)."""

    def num_blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    def free_lookup_locks(self, token_ids: list[int], start: int, end: int, request_id: str,
                          cache_salt: str = "") -> None:
        """The seed's signature; kvdepot's locks belong to the lookup's request id, so the
        tokens and the salt are not needed."""
        self.release_locks(request_id, start, end)


class LMCacheMPWorkerAdapter(WorkerClient):
    """Worker-side adapter (KV registration, stores, retrieves, completion polling)."""

    def num_blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size


__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_MQ_TIMEOUT",
    "BlockAllocationRecord",
    "HeartbeatThread",
    "LMCacheMPSchedulerAdapter",
    "LMCacheMPWorkerAdapter",
    "LoadStoreOp",
    "LookupResult",
    "ParallelStrategy",
    "RetrieveResult",
    "StoreResult",
]
