"""The seed-compatible engine adapters: LMCache multiprocess-mode names over kvdepot.

An engine integration written against LMCache's `vllm_multi_process_adapter` works
unchanged with these names; they are kvdepot's own clients under the names and
signatures that integration expects.
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


class LMCacheMPWorkerAdapter(WorkerClient):
    """Worker-side adapter (KV registration, stores, retrieves, completion polling)."""


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
