"""The connector's two halves for a model kvdepot refuses to serve (issue 44).

A model whose KV cache groups a chunk cannot carry (a recurrent layer's state beside the
attention KV: `connector.unservable_groups`) must still run: vLLM builds the connector
for every engine started with `--kv-transfer-config`, and an exception at start would
stop the engine. These halves answer vLLM as a connector that never holds anything does:
no external hit, nothing to load or store, every request's blocks free at once. They
never connect to the server, so nothing of the engine (its block size included, which
vLLM raises to fit a recurrent state's page) has to suit kvdepot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvdepot.integrations.vllm.metadata import KVDepotConnectorMetadata

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class RefusedSchedulerSide:
    """`SchedulerSide`'s calls, for a refused model: no lookup, no load, no store."""

    def on_new_request(self, request: Request) -> None:
        return

    def may_load(self, request: Request) -> bool:
        return False

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        return

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVDepotConnectorMetadata:
        return KVDepotConnectorMetadata()  # the worker's half expects one every step

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        return

    def request_finished(self, request: Request) -> bool:
        return False  # nothing reads the request's blocks: vLLM frees them at once

    def take_events(self) -> list[KVCacheEvent]:
        return []

    def shutdown(self) -> None:
        return


class RefusedWorkerSide:
    """`WorkerSide`'s calls, for a refused model: nothing registered or transferred."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        return

    def unregister_kv_caches(self) -> None:
        return

    def restore_kv_caches(self) -> None:
        return

    def on_metadata(self, meta: KVDepotConnectorMetadata) -> None:
        return

    def handle_preemptions(self, meta: KVDepotConnectorMetadata) -> None:
        return

    def start_loads(self, meta: KVDepotConnectorMetadata) -> None:
        return

    def submit_stores(self, meta: KVDepotConnectorMetadata) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()

    def get_failed_loads(self) -> set[str]:
        return set()

    def get_load_errors(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        return
