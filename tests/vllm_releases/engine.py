"""A vLLM engine without a model, for scheduler-level tests of one vLLM release.

The scheduler is vLLM's own `Scheduler` (its requests, its outputs, its KV cache manager,
its connector factory, which builds the scheduler-side `KVDepotConnector`); the worker side
is a `KVDepotConnector` of the worker role over real CPU KV tensors registered with a real
kvdepot server. What stands in for the model runner is this file's `step`: it calls the
worker-side connector in the order the release's runner does, and "computes" each
scheduled token by writing a value derived from the token and its position into every
layer's K and V of that token's slot, so a test can tell a load that wrote the right bytes
from one that wrote nothing.

Everything here imports only what the release under test provides; what differs between
releases (a field of an output class, `get_transfer_results`) is looked up on vLLM's own
classes, never assumed from a version number.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvdepot.integrations.vllm.connector import KVDepotConnector

BLOCK = 16
HEADS = 2
HEAD_DIM = 4
EOS = 2
SLIDING_WINDOW = 64
"""Tokens a sliding-window group attends to (four blocks): with two groups, the second
one is a sliding window, as in Gemma 3 or gpt-oss."""

_hash_ready = False


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


STATE_WIDTH = 8
"""Values in the stand-in recurrent layer's state (one per block, as vLLM keeps them)."""


def next_state(state: float, token: int, position: int) -> float:
    """The stand-in recurrent layer: its state after one more token, from the state before
    it (so a state loaded wrongly, or not at all, shows in every later one); exact in
    float32."""
    return float((state * 31 + token * 7 + position) % 8_000_000)


def state_after(tokens: Sequence[int]) -> float:
    """The stand-in state after `tokens`, computed from the start."""
    state = 0.0
    for position, token in enumerate(tokens):
        state = next_state(state, token, position)
    return state


def kv_value(token: int, position: int, layer: int, kv: int) -> float:
    """What the stand-in model writes for a token: distinct per token, position, layer and
    K or V, exact in float32 (all below 2**24)."""
    return float(((token * 4099 + position) * 4 + layer) * 2 + kv) % 16_000_000


class Engine:
    """vLLM's scheduler and the worker-side connector of one engine, stepped by hand."""

    def __init__(self, model_dir: Path, url: str, identity: str, *, groups: int = 1,
                 recurrent: bool = False,
                 num_blocks: int = 200, max_num_seqs: int = 8, token_budget: int = 512,
                 head_dim: int = HEAD_DIM, kv_events_endpoint: str | None = None,
                 scheduler_options: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None, async_scheduling: bool = False) -> None:
        """`identity`: the connector's `kvdepot.model_identity` (engines share chunks only
        under the same one); `head_dim`: another than another engine's makes its chunks of
        another layout, which a retrieve refuses; `kv_events_endpoint`: the engine publishes
        vLLM's KV events there (ZeroMQ); `recurrent`: a hybrid model, group 0 a recurrent
        layer whose state vLLM keeps at block boundaries ("align"), group 1 attention, as
        Qwen3-Next; `async_scheduling`: the configuration says vLLM
        schedules asynchronously, as on a GPU (set after the configuration is made, which
        decides it by platform; the scheduler here steps in turn either way)."""
        extra_config = {"kvdepot.url": url, "kvdepot.model_identity": identity,
                        "kvdepot.lookup_timeout": 10.0, "kvdepot.heartbeat_interval": 1.0,
                        **(extra or {})}
        model = ModelConfig(model=str(model_dir), dtype="float32", seed=0,
                            skip_tokenizer_init=True, max_model_len=4096)
        self.config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=token_budget,
                max_model_len=4096, enable_chunked_prefill=True, is_encoder_decoder=False,
                **(scheduler_options or {})),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True,
                                     **({"mamba_cache_mode": "align"} if recurrent else {})),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVDepotConnector",
                kv_connector_module_path="kvdepot.integrations.vllm",
                kv_role="kv_both", kv_connector_extra_config=extra_config),
            device_config=DeviceConfig("cpu"),
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events_endpoint,
            ) if kv_events_endpoint else None,
        )
        self.config.cache_config.num_gpu_blocks = num_blocks
        # Said outright: some releases' configurations turn it on for a CPU device too,
        # while the scheduler here steps in turn.
        self.config.scheduler_config.async_scheduling = async_scheduling
        # The scheduler and the worker run in this one process, as under vLLM's
        # single-process executor (which some releases' configurations do not pick for a
        # CPU device): said outright, since the connector stages loads only there.
        self.config.parallel_config.distributed_executor_backend = "uni"
        specs: list[Any] = [FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS,
                                              head_size=head_dim, dtype=torch.float32)]
        if recurrent:
            specs.insert(0, MambaSpec(block_size=BLOCK, shapes=((STATE_WIDTH,),),
                                      dtypes=(torch.float32,), mamba_cache_mode="align"))
        if groups == 2:
            specs.append(SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS,
                                           head_size=head_dim, dtype=torch.float32,
                                           sliding_window=SLIDING_WINDOW))
        self.layers = [f"layers.{i}.{'state' if isinstance(spec, MambaSpec) else 'attn'}"
                       for i, spec in enumerate(specs)]
        self.state_layer = self.layers[0] if recurrent else None
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([name], spec)
                             for name, spec in zip(self.layers, specs, strict=True)])
        self.scheduler = Scheduler(
            vllm_config=self.config, kv_cache_config=self.kv_cache_config, log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config), block_size=BLOCK)
        connector = self.scheduler.connector
        assert isinstance(connector, KVDepotConnector), type(connector)
        self.scheduler_connector = connector
        # vLLM's flash-attention layout, one tensor per layer: [K|V, blocks, slots, heads, dim].
        self.kv = {name: torch.zeros(num_blocks, 1, 1, STATE_WIDTH) if name == self.state_layer
                   else torch.zeros(2, num_blocks, BLOCK, HEADS, head_dim)
                   for name in self.layers}
        self.worker = KVDepotConnector(self.config, KVConnectorRole.WORKER,
                                       self.kv_cache_config)
        self.worker.register_kv_caches(self.kv)
        self.outputs: list[Any] = []
        self.loading: dict[str, int] = {}
        """Requests seen waiting for an asynchronous load, with the tokens vLLM counted
        computed then (its own prefix hit and the load)."""
        self.inline_loads: dict[str, int] = {}
        """Requests scheduled with a synchronous load, with where it ends."""
        self.staged_loads: dict[str, list[int]] = {}
        """Requests scheduled with a staged load (`staging`), with the blocks it moved."""
        self.load_steps: dict[str, int] = {}
        """Per request with an asynchronous load, the steps from the one that planned it
        to the one that computed the request (1: computed in the next step)."""
        self._steps = 0
        self._load_planned: dict[str, int] = {}
        self.waiting_steps: list[bool] = []
        """Per step that computed nothing, whether it asked the worker to wait for the
        pending loads (`KVDepotConnectorMetadata.wait_for_loads`)."""
        self.layer_hooks_asked: list[bool] = []
        """Per step, whether vLLM's gate around each attention layer would call the
        connector's per-layer hooks (`has_connector_metadata` once bound)."""

    # ---- requests --------------------------------------------------------------------

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int = 4) -> Request:
        global _hash_ready
        if not _hash_ready:
            init_none_hash(sha256)
            _hash_ready = True
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        request = Request(request_id=request_id, prompt_token_ids=list(prompt),
                          sampling_params=params, pooling_params=None,
                          block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.scheduler.add_request(request)
        return request

    # ---- one engine step -------------------------------------------------------------

    def step(self) -> Any:
        """One scheduler step and the worker's part in it; the scheduler's output."""
        out = self.scheduler.schedule()
        for request in self.scheduler.requests.values():
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.loading.setdefault(request.request_id, request.num_computed_tokens)
        meta = out.kv_connector_metadata
        self._steps += 1
        for load in getattr(meta, "loads", ()):
            if load.inline:
                assert load.request_id in out.num_scheduled_tokens, "loaded outside its step"
                self.inline_loads[load.request_id] = load.end
            else:
                self._load_planned.setdefault(load.request_id, self._steps)
        for staged in getattr(meta, "staged", ()):
            assert staged.request_id in out.num_scheduled_tokens, "moved outside its step"
            self.staged_loads[staged.request_id] = list(staged.block_ids)
        for req_id in out.num_scheduled_tokens:
            if req_id in self._load_planned and req_id not in self.load_steps:
                self.load_steps[req_id] = self._steps - self._load_planned[req_id]
        if not out.num_scheduled_tokens:
            self.waiting_steps.append(bool(getattr(meta, "wait_for_loads", False)))
        worker = self.worker
        worker.bind_connector_metadata(meta)
        self.layer_hooks_asked.append(worker.has_connector_metadata())
        worker.handle_preemptions(meta)
        worker.start_load_kv(None)  # type: ignore[arg-type]
        for req_id, count in out.num_scheduled_tokens.items():
            self._compute(req_id, count)
        worker.wait_for_save()
        connector_output = self._connector_output(out.finished_req_ids)
        worker.clear_connector_metadata()
        runner = self._runner_output(out, connector_output)
        self.outputs.append(self.scheduler.update_from_output(out, runner))
        return out

    def run(self, until: Callable[[], bool], timeout: float = 30.0) -> None:
        """Step until `until()` holds. Loads and stores complete on the server's time, not
        the engine's: a step that scheduled nothing waits a little before the next."""
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine state after {timeout} s: {self.describe()}")
            if not self.step().num_scheduled_tokens:
                time.sleep(0.005)

    def describe(self) -> str:
        return ", ".join(f"{r.request_id}: {r.status.name} {r.num_computed_tokens}/"
                         f"{r.num_tokens}" for r in self.scheduler.requests.values())

    def _connector_output(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """As the release's model runner collects it: `get_transfer_results` where the
        base class has it (vLLM 0.30 on), else `get_finished`."""
        output = KVConnectorOutput()
        worker = self.worker
        if hasattr(KVConnectorBase_V1, "get_transfer_results"):
            results = worker.get_transfer_results(finished_req_ids)
            output.finished_sending = results.finished_sending or None
            output.finished_recving = results.finished_recving or None
            output.failed_recving = results.failed_recving
        else:
            output.finished_sending, output.finished_recving = worker.get_finished(
                finished_req_ids)
        output.invalid_block_ids = worker.get_block_ids_with_load_errors()
        output.kv_cache_events = worker.get_kv_connector_kv_cache_events()
        output.kv_connector_worker_meta = worker.build_connector_worker_meta()
        return output

    def _compute(self, req_id: str, count: int) -> None:
        request = self.scheduler.requests[req_id]
        # The scheduler has already counted this step's tokens as computed.
        start = request.num_computed_tokens - count
        groups = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        tokens = request.all_token_ids
        if self.state_layer is not None:
            # As vLLM's workers in "align" mode: the step starts from the state in the
            # block of its first token's predecessor and leaves the state after its last
            # token in that token's block.
            end = min(start + count, len(tokens))
            states = self.kv[self.state_layer]
            state = states[groups[0][(start - 1) // BLOCK], 0, 0, 0].item() if start else 0.0
            for position in range(start, end):
                state = next_state(state, tokens[position], position)
            states[groups[0][(end - 1) // BLOCK]] = state
        for position in range(start, min(start + count, len(tokens))):
            for layer, name in enumerate(self.layers):
                if name == self.state_layer:
                    continue
                block = groups[layer][position // BLOCK]
                for kv in (0, 1):
                    self.kv[name][kv, block, position % BLOCK] = kv_value(
                        tokens[position], position, layer, kv)

    def _runner_output(self, out: Any, connector_output: KVConnectorOutput) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            # A prompt still being prefilled samples nothing; one done samples a token.
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([1000 + len(request.output_token_ids)] if done else [])
        kwargs: dict[str, Any] = {
            "req_ids": req_ids, "sampled_token_ids": sampled, "logprobs": None,
            "prompt_logprobs_dict": {}, "pooler_output": None,
            "kv_connector_output": connector_output}
        if "req_id_to_index" in _fields(ModelRunnerOutput):
            kwargs["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        return ModelRunnerOutput(**kwargs)

    # ---- what tests look at ----------------------------------------------------------

    def written_correctly(self, req_id: str, end: int) -> bool:
        """Whether every held block of the request holds the stand-in model's values for
        its tokens [0, end), in every layer (blocks a sliding window let go are skipped)."""
        request = self.scheduler.requests[req_id]
        groups = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        tokens = request.all_token_ids
        for position in range(end):
            for layer, name in enumerate(self.layers):
                if name == self.state_layer:
                    continue
                block = groups[layer][position // BLOCK]
                if block == 0:  # vLLM's null block: outside the sliding window
                    continue
                for kv in (0, 1):
                    want = kv_value(tokens[position], position, layer, kv)
                    if self.kv[name][kv, block, position % BLOCK, 0, 0].item() != want:
                        return False
        return True

    def state_correct(self, req_id: str) -> bool:
        """Whether the request's state after its computed tokens is the one computing them
        all from the start gives (so the state it started from, loaded or computed, was)."""
        request = self.scheduler.requests[req_id]
        computed = request.num_computed_tokens
        block = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0][(computed - 1) // BLOCK]
        have = self.kv[self.state_layer][block, 0, 0, 0].item()
        return have == state_after(request.all_token_ids[:computed])

    def forget_kv(self) -> None:
        """Zero every layer's KV, as if the blocks had been reused: what a request holds
        afterwards it computed or loaded."""
        for tensor in self.kv.values():
            tensor.zero_()

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler_connector.shutdown()
