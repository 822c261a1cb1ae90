"""KVDepotConnector timing what vLLM calls, for `trace_load.py` (a profiling aid, not
part of the package): each event is a line `TRACE <CLOCK_MONOTONIC in ms> <event>` on
stderr, comparable across the engine's processes. Besides the connector's own calls it
times vLLM's scheduler (`schedule`, `update_from_output`, `add_request`) and the worker
client's retrieve submission and wait, patched in the engine's process when vLLM first
builds the connector there."""

from __future__ import annotations

import sys
import time
from typing import Any

from kvdepot.integrations.vllm.connector import KVDepotConnector


def log(*parts: Any) -> None:
    print(f"TRACE {time.monotonic() * 1e3:.3f}", *parts, file=sys.stderr, flush=True)


_patched = False


def _patch_vllm() -> None:
    """Time vLLM's scheduler steps and the worker client's retrieves (once per process)."""
    global _patched
    if _patched:
        return
    _patched = True
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule, update, add = Scheduler.schedule, Scheduler.update_from_output, Scheduler.add_request

    def traced_schedule(self: Any, *a: Any, **k: Any) -> Any:
        t = time.monotonic()
        out = schedule(self, *a, **k)
        log(f"schedule {1e3 * (time.monotonic() - t):.3f} ms tokens "
            f"{out.total_num_scheduled_tokens} new {[r.req_id for r in out.scheduled_new_reqs]}")
        return out

    def traced_update(self: Any, so: Any, mo: Any) -> Any:
        t = time.monotonic()
        out = update(self, so, mo)
        kv = getattr(mo, "kv_connector_output", None)
        log(f"update_from_output {1e3 * (time.monotonic() - t):.3f} ms recving "
            f"{getattr(kv, 'finished_recving', None)}")
        return out

    def traced_add(self: Any, request: Any) -> Any:
        log(f"add_request {request.request_id} {request.num_prompt_tokens}")
        return add(self, request)

    from kvdepot.client.worker import WorkerClient

    submit, wait = WorkerClient.batched_submit_retrieve_requests, WorkerClient.wait_for_retrieves

    def traced_submit(self: Any, ids: Any, *a: Any, **k: Any) -> Any:
        t = time.monotonic()
        out = submit(self, ids, *a, **k)
        log(f"submit_retrieves {list(ids)} {1e3 * (time.monotonic() - t):.3f} ms")
        return out

    def traced_wait(self: Any, timeout: float) -> Any:
        log("wait_for_retrieves enter")
        out = wait(self, timeout)
        log("wait_for_retrieves exit")
        return out

    WorkerClient.batched_submit_retrieve_requests = traced_submit
    WorkerClient.wait_for_retrieves = traced_wait
    Scheduler.schedule = traced_schedule
    Scheduler.update_from_output = traced_update
    Scheduler.add_request = traced_add


class TraceConnector(KVDepotConnector):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        _patch_vllm()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        t = time.monotonic()
        out = super().get_num_new_matched_tokens(request, num_computed_tokens)
        log(f"matched {request.request_id} local {num_computed_tokens} -> {out} "
            f"{1e3 * (time.monotonic() - t):.3f} ms")
        return out

    def update_state_after_alloc(self, request: Any, blocks: Any, n: int) -> None:
        super().update_state_after_alloc(request, blocks, n)
        log(f"after_alloc {request.request_id} external {n}")

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        log(f"build_meta loads {len(meta.loads)} staged {len(meta.staged)} stores "
            f"{len(meta.stores)} wait {meta.wait_for_loads}")
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        log("start_load_kv enter")
        super().start_load_kv(forward_context, **kwargs)
        log("start_load_kv exit")

    def wait_for_save(self) -> None:
        super().wait_for_save()
        log("wait_for_save exit")

    def get_finished(self, finished_req_ids: set[str]) -> Any:
        out = super().get_finished(finished_req_ids)
        if out[1]:
            log(f"get_finished recving {out[1]}")
        return out

    def update_connector_output(self, connector_output: Any) -> None:
        if connector_output.finished_recving:
            log(f"update_connector_output recving {connector_output.finished_recving}")
        super().update_connector_output(connector_output)
