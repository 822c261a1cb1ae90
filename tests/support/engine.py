"""A synthetic engine in its own process, driven through the seed-compatible adapters.

The parent test sends calls over a pipe; the child owns real KV tensors (in any
supported layout), a worker adapter that registered them, and a scheduler adapter:
exactly the objects a vLLM connector would hold, in a separate process.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch
import zmq

from tests.support import forked
from tests.support.layouts import block_axis, blocks, fill_random, make_kv_caches


class _Engine:
    def __init__(self, url: str, layout: str = "vllm_cpu", num_layers: int = 2,
                 num_blocks: int = 32, block_size: int = 16, model: str = "test-model",
                 world_size: int = 1, rank: int = 0, tp_size: int = 1, use_mla: bool = False,
                 heartbeat_interval: float = 0.5, mq_timeout: float = 5.0,
                 credentials: str | None = None, groups: int = 1,
                 layout_hints: dict[str, Any] | None = None, tp_rank: int = 0,
                 device: str = "cpu", heads: int = 2, head_dim: int = 32,
                 state_groups: tuple[int, ...] = (), state_bytes: int = 256,
                 state_layers: int = 2) -> None:
        """`rank` is the KV rank; with MLA it counts PP stages only and `tp_rank` is this
        worker's place in its TP group (vLLM numbers workers rank * tp_size + tp_rank).
        `device="cuda"`: the KV cache lives on the GPU, and every store and retrieve waits
        for an interprocess event recorded after the engine's writes, as vLLM's do.
        `state_groups`: those groups (numbers below `groups`) hold recurrent states, as a
        hybrid model's Gated DeltaNet layers do: `state_layers` layers each, every one an
        int8 tensor `[num_blocks, 1, 1, state_bytes]` of its own (one state per block),
        registered with the `kv_export.STATE_HINT` hint (`self.states`)."""
        from kvdepot.integrations.vllm.mp_adapter import (
            LMCacheMPSchedulerAdapter,
            LMCacheMPWorkerAdapter,
            ParallelStrategy,
        )

        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.workload: Any = None
        strategy = ParallelStrategy(
            use_mla=use_mla, kv_world_size=world_size, kv_worker_id=rank,
            actual_world_size=world_size * (tp_size if use_mla else 1),
            actual_worker_id=rank * tp_size + tp_rank if use_mla else rank, tp_size=tp_size,
            pp_size=1)
        ctx = zmq.Context()
        common = dict(vllm_block_size=block_size, parallel_strategy=strategy,
                      mq_timeout=mq_timeout, heartbeat_interval=heartbeat_interval,
                      credentials=credentials)
        self.worker = LMCacheMPWorkerAdapter(url, ctx, model, **common)
        self.scheduler = LMCacheMPSchedulerAdapter(url, ctx, model, **common)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:  # torch.cuda.set_device needs an index
                self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        self.caches = make_kv_caches(layout, num_layers, num_blocks, block_size, heads=heads,
                                     head_dim=head_dim, device=str(self.device),
                                     alias=groups == 1)
        self.before_register = {k: v[...] for k, v in self.caches.items()}
        self.states = {f"group{g}.state{i}": torch.zeros(num_blocks, 1, 1, state_bytes,
                                                         dtype=torch.int8, device=self.device)
                       for g in state_groups for i in range(state_layers)}
        if state_groups:
            from kvdepot.client.kv_export import GROUP_HINT, STATE_HINT

            named = {}
            for g in range(groups):
                if g in state_groups:
                    named |= {k: t for k, t in self.states.items()
                              if k.startswith(f"group{g}.")}
                else:
                    named |= {f"group{g}.{name}": t for name, t in self.caches.items()}
            hints = layout_hints if layout_hints is not None else {
                GROUP_HINT: [int(k.split(".")[0].removeprefix("group")) for k in named],
                STATE_HINT: [k in self.states for k in named]}
            self.worker.register_kv_caches(named, extra_layout_hints=hints)
        elif groups == 1 and layout_hints is None:
            self.worker.register_kv_caches(self.caches)
        else:
            # vLLM's hybrid KV cache manager: every group has a name for each layer's
            # memory (one layer per group shares each tensor), and numbers its own blocks.
            named = {f"group{g}.{name}": t for g in range(groups)
                     for name, t in self.caches.items()}
            hints = layout_hints if layout_hints is not None else {
                "per_layer_kv_cache_group_id": [g for g in range(groups) for _ in self.caches]}
            self.worker.register_kv_caches(named, extra_layout_hints=hints)

    # ---- data --------------------------------------------------------------------
    def fill(self, seed: int) -> None:
        fill_random(self.caches, seed)
        generator = torch.Generator(device="cpu").manual_seed(seed + 1_000_003)
        for t in self.states.values():
            t.copy_(torch.randint(-128, 128, t.shape, generator=generator, dtype=torch.int8))

    def read_states(self, ids: list[int]) -> list[torch.Tensor]:
        """Copies of blocks `ids` of every recurrent-state layer (`self.states`)."""
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        return [t.index_select(0, index).cpu() for t in self.states.values()]

    def fill_blocks(self, ids: list[int], seed: int) -> None:
        """Random values drawn from `seed` into blocks `ids` of every layer (the rest of
        the cache stays as it is, so large caches fill fast)."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        axis = block_axis(self.layout)
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for t in self.caches.values():
            view = (t.data_ptr(), tuple(t.stride()))
            if view in seen:  # an alias of a layer already filled
                continue
            seen.add(view)
            shape = list(t.shape)
            shape[axis] = len(ids)
            values = torch.randn(shape, generator=generator, dtype=torch.float32)
            t.index_copy_(axis, index, values.to(t.dtype).to(t.device))

    def read_blocks(self, ids: list[int]) -> list[torch.Tensor]:
        """Copies in this process's memory (GPU blocks too: the parent compares them)."""
        return [t.cpu() for t in blocks(self.caches, self.layout, ids)]

    def write_through_old_view(self, value: float) -> None:
        """Write via the tensors as they were before registration (views must stay live)."""
        for t in self.before_register.values():
            t.fill_(value)
        for t in self.states.values():
            t.fill_(int(value))

    def fill_value(self, ids: list[int], value: float) -> None:
        """Write `value` into blocks `ids` of every layer (the engine reusing them)."""
        axis = block_axis(self.layout)
        for t in self.caches.values():
            t.index_fill_(axis, torch.tensor(ids, dtype=torch.long, device=t.device), value)

    def blocks_hold(self, ids: list[int], value: float) -> bool:
        return all(bool((t == value).all()) for t in self.read_blocks(ids))

    # ---- operations ------------------------------------------------------------------
    def lookup(self, req: str, tokens: list[int], salt: str = "", timeout: float = 10,
               block_hashes: list[bytes] = (), held_blocks: int = 0, tails: bool = False,
               states: bool = False) -> int:
        self.scheduler.maybe_submit_lookup_request(req, tokens, cache_salt=salt,
                                                   block_hashes=block_hashes,
                                                   held_blocks=held_blocks, tails=tails,
                                                   states=states)
        deadline = time.monotonic() + timeout
        while (result := self.scheduler.check_lookup_result(req)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError("lookup never finished")
            time.sleep(0.005)
        return result

    def _op(self, tokens: list[int], block_ids: list[int], start: int, end: int, skip: int = 0,
            block_hashes: bytes = b"", tail: int = 0, state_groups: tuple[int, ...] = ()):
        from kvdepot.integrations.vllm.mp_adapter import LoadStoreOp

        return LoadStoreOp(token_ids=tokens, block_ids=block_ids, start=start, end=end,
                           skip_first_n_tokens=skip, block_hashes=block_hashes,
                           hash_block_size=self.block_size if block_hashes else 0,
                           tail_tokens=tail, state_groups=tuple(state_groups))

    def _event(self) -> Any:
        """What the server waits for before it copies: None on CPU (the engine's writes are
        done when it submits); on a GPU, everything queued on the engine's stream so far."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _wait(self, req: str, sending: bool, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            done_send, done_recv = self.worker.get_finished({req} if sending else set())
            if req in (done_send if sending else done_recv):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{req} never finished")
            time.sleep(0.002)

    def store(self, req: str, tokens: list[int], block_ids: list[int], start: int, end: int,
              salt: str = "", block_hashes: bytes = b"", tail: int = 0,
              state_groups: tuple[int, ...] = ()) -> None:
        """`block_hashes`: vLLM block hashes of [start, end), one per block, concatenated.
        `tail`: the range ends in a tail of that many tokens. `state_groups`: the op
        carries the recurrent state after `end` (`LoadStoreOp.state_groups`). Why it
        failed, if it did: `last_errors`."""
        op = self._op(tokens, block_ids, start, end, block_hashes=block_hashes, tail=tail,
                      state_groups=state_groups)
        self.worker.submit_store_request(req, op, self._event(), cache_salt=salt)
        operation = (self.worker.store_ops.get(req) or [None])[-1]
        self._wait(req, sending=True)
        self._last_errors = [str(operation.error)] if operation and operation.error else []

    def last_errors(self) -> list[str]:
        """Why the last `store` or `retrieve` failed (the server's message): empty if it
        did not."""
        return getattr(self, "_last_errors", [])

    def block_events(self, count: int, wait: float = 20) -> list[tuple[Any, ...]]:
        """The scheduler's block events (client/block_event_poller.py) until `count` have come
        or `wait` seconds have passed:
        (stored, medium, block hashes, parent hash, block size) each."""
        from kvdepot.client.block_event_poller import BlockEventPoller

        if not hasattr(self, "_poller"):
            self._poller = BlockEventPoller(self.scheduler, interval=0.01)
        got: list[tuple[Any, ...]] = []
        deadline = time.monotonic() + wait
        while len(got) < count and time.monotonic() < deadline:
            got += [(e.stored, e.medium, e.block_hashes, e.parent_block_hash, e.block_size)
                    for e in self._poller.take()]
            time.sleep(0.01)
        return got

    def submit_store(self, req: str, tokens: list[int], block_ids: list[int], start: int,
                     end: int) -> None:
        self.worker.submit_store_request(req, self._op(tokens, block_ids, start, end),
                                         self._event())

    def submit_retrieve(self, req: str, tokens: list[int], block_ids: list[int], start: int,
                        end: int) -> None:
        self.worker.submit_retrieve_request(req, self._op(tokens, block_ids, start, end),
                                            self._event())

    def retrieve(self, req: str, tokens: list[int], block_ids: list[int], start: int, end: int,
                 skip: int = 0, salt: str = "", tail: int = 0,
                 state_groups: tuple[int, ...] = ()) -> set[int]:
        """Returns the blocks reported as load errors (why: `last_errors`)."""
        self.worker.submit_retrieve_request(
            req, self._op(tokens, block_ids, start, end, skip, tail=tail,
                          state_groups=state_groups), self._event(), cache_salt=salt)
        operation = (self.worker.retrieve_ops.get(req) or [None])[-1]
        self._wait(req, sending=False)
        self._last_errors = [str(operation.error)] if operation and operation.error else []
        return self.worker.get_block_ids_with_load_errors()

    def release_locks(self, req: str, start: int, end: int) -> None:
        self.scheduler.release_locks(req, start, end)

    def get_finished(self, finished: set[str]) -> tuple[set[str], set[str], set[int]]:
        s, r = self.worker.get_finished(finished)
        return s, r, self.worker.get_block_ids_with_load_errors()

    def has_pending_store(self, req: str) -> bool:
        return self.worker.has_pending_store(req)

    # ---- the verifying workload (kvdepot.testbed.verified_workload) -----------------------
    def workload_run(self, seconds: float, seed: int) -> dict[str, Any]:
        from kvdepot.testbed.verified_workload import VerifiedWorkload

        if self.workload is None:
            self.workload = VerifiedWorkload(
                self.worker, self.scheduler, self.caches, self.num_blocks, self.block_size,
                self.scheduler.chunk_size, seed, block_axis=block_axis(self.layout))
        return self.workload.run(seconds).as_dict()

    def workload_finish(self) -> dict[str, Any]:
        return self.workload.finish().as_dict()

    def registration_id(self) -> bytes:
        return self.worker.instance_id

    def drop_registration_behind_its_back(self) -> None:
        """Register a tiny cache from this process on another connection, replacing the
        worker's registration: the server then answers the worker NotRegistered."""
        from kvdepot.rpc.connection import DepotConnection
        from tests.support.raw_registration import register

        conn = DepotConnection(self.worker.mq_client.url)
        try:
            register(conn, {"l0": torch.zeros(4, 2, 16, 32, dtype=torch.bfloat16)},
                     replaces=self.worker.instance_id)
        finally:
            conn.close()

    def truncate_handed_over_files(self) -> list[str]:
        """Shrink every file this worker handed to the server (KV memory and fence) to
        nothing, as a hostile tenant would; returns what each attempt got."""
        import os

        outcomes = []
        for fd in self.worker._files.fds:
            try:
                os.ftruncate(fd, 0)
                outcomes.append("truncated")
            except OSError as exc:
                outcomes.append(type(exc).__name__)
        return outcomes

    def fence_inode(self) -> int:
        """The inode of the fence file this worker handed over: the server's locks on it
        (/proc/locks) show it copying one of this worker's operations."""
        import os

        return os.fstat(self.worker._fence.fd).st_ino

    def register_again(self) -> None:
        """register_kv_caches once more with the same tensors (a retried registration)."""
        self.worker.register_kv_caches(self.caches)

    def lookup_results_held(self) -> int:
        """Lookup results the scheduler client still keeps (cleaned up ones are gone)."""
        return len(self.scheduler._finished_lookup_results) + len(
            self.scheduler._pending_lookups)

    def healthy(self) -> tuple[bool, bool]:
        return self.scheduler.is_healthy, self.worker.is_healthy

    def call(self, obj: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call any adapter method directly (error-path tests)."""
        return getattr(getattr(self, obj), method)(*args, **kwargs)

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def _serve(conn: Any, kwargs: dict[str, Any]) -> None:
    try:
        engine = _Engine(**kwargs)
        conn.send(("ok", None))
    except BaseException as exc:
        conn.send(("error", (type(exc).__name__, str(exc), traceback.format_exc())))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            break
        method, args, kw = msg
        try:
            conn.send(("ok", getattr(engine, method)(*args, **kw)))
        except BaseException as exc:
            conn.send(("error", (type(exc).__name__, str(exc), traceback.format_exc())))


class EngineError(Exception):
    def __init__(self, name: str, message: str, tb: str) -> None:
        super().__init__(f"{name}: {message}\n--- in the engine process ---\n{tb}")
        self.name = name
        self.message = message


class EngineProcess:
    """Parent-side handle: `engine.store(...)` runs in the child and returns its result."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        ctx = forked.context()
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=forked.run_here, daemon=True, args=forked.target_args(
            __name__, "_serve", child, {"url": url, **kwargs}))
        self.proc.start()
        child.close()
        self._result(timeout=120)

    def _result(self, timeout: float) -> Any:
        # The child's end is closed here, so a child that dies ends the wait at once.
        try:
            if not self._conn.poll(timeout):
                raise TimeoutError("the engine process did not answer")
            status, value = self._conn.recv()
        except EOFError:
            self.proc.join(5)
            raise EngineError("EngineExited", f"the engine process exited (code "
                              f"{self.proc.exitcode})", "") from None
        if status == "error":
            raise EngineError(*value)
        return value

    def __getattr__(self, method: str) -> Any:
        def call(*args: Any, timeout: float = 120, **kwargs: Any) -> Any:
            self._conn.send((method, args, kwargs))
            return self._result(timeout)

        return call

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("shutdown", (), {}))
                self._result(timeout=30)
                self._conn.send(None)
            except (OSError, EOFError, TimeoutError, EngineError):
                pass
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()


def locked_for_a_load(engine: EngineProcess, tokens: list[int], value: float,
                      chunk: int) -> list[int]:
    """Two chunks of `tokens` stored from blocks 0-7 holding `value`, then looked up as
    request "load" (the server locks them for it); returns the blocks it is to load them
    into, 16-23, zeroed first so a load that never ran shows."""
    engine.fill_value(list(range(8)), value)
    engine.store("prep", tokens, list(range(8)), 0, 2 * chunk)
    assert engine.lookup("load", tokens) == 2 * chunk
    targets = list(range(16, 24))
    engine.fill_value(targets, 0.0)
    return targets
