"""A real vLLM engine on the GPU with KVDepotConnector (vLLM 0.26 on the GPU machine).

Skips where no CUDA device or no vLLM is installed (CI has neither). A small Llama (4
layers of width 512) with seeded weights in bfloat16, chunks of 256 tokens, blocks of 16:

- a kvdepot hit is vLLM's own prefix-cache hit bit for bit (16 greedy tokens and their
  top-5 log-probabilities; in bfloat16 every hit drifts from the cold run, and both hits
  compute the prompt's last token on the same KV: `correctness.py`, exact mode), all but
  the last token loaded (by the server's counters and by vLLM's own count of the
  request's cached tokens), and a control prompt differs; before the kvdepot hit another
  prompt of the same length runs, so the hit cannot pass on KV left in vLLM's blocks;
- vLLM's own hit does not wait for kvdepot;
- sleep mode, whose KV memory no other process can map on this vLLM, runs the engine
  without kvdepot: no registration, lookup or store.

One engine with the connector serves the first two tests; the sleep-mode test needs an
engine of its own (sleep mode is set per engine), so the first is shut down before it
starts and at most one engine holds the GPU at a time.

Every vLLM call runs in a thread of its own and is waited for at most a set time (an
engine start 420 s, a request 180 s, ...): vLLM's `LLM` calls themselves wait without a
limit, and a request whose KV load never completes would hang the test with no output.
A call past its limit fails the test, naming the step and where the call was stuck; the
engine is then given up (its processes killed at the end) and later tests fail at once.
Progress goes to stderr as `[vllm-gpu +SECONDS s] ...` lines: `pytest -s` shows them live.

Expected on an H100 (not yet measured with this file): the first engine start on a fresh
machine took 70-100 s before, most of it FlashInfer's JIT and autotuning, both turned off
here (the FlashInfer sampler, whose kernels greedy sampling never uses, and FlashInfer's
autotuning, a search for fast kernels that these checks do not need), so expect 30-100 s;
the sleep-mode engine's start about 10-20 s; requests well under a second each. About 1.5
to 3 minutes for the module. A hang fails its test within its bound (7 minutes for an
engine start, 3 for a request).
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch

vllm = pytest.importorskip("vllm")

from kvdepot.testbed.checkpoint import SIZES, seeded_checkpoint  # noqa: E402
from kvdepot.testbed.correctness import (  # noqa: E402
    OUTPUT_TOKENS,
    TOP_LOGPROBS,
    Ask,
    check_correctness,
    probe_length,
)
from kvdepot.testbed.server_process import ServerProcess  # noqa: E402
from kvdepot.testbed.vllm_engine import Completion, kv_transfer_config, random_tokens  # noqa: E402

pytestmark = [
    pytest.mark.gpu, pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    # pytest-timeout, where installed: past every bounded wait below, so those fail first
    # with their own message.
    pytest.mark.timeout(1200),
]

CHUNK = 256
MODEL = {**SIZES["medium"], "torch_dtype": "bfloat16", "max_position_embeddings": 8192}

ENGINE_START_S = 420.0
"""The first start on a fresh machine takes 70-100 s; six times that is a hang."""
REQUEST_S = 180.0
"""A request of a few thousand tokens on this model takes well under a second; the
first ones after a start may compile a few Triton kernels."""
CALL_S = 120.0
"""Other engine calls: resetting the prefix cache, sleep, wake-up."""
SHUTDOWN_S = 120.0
REGISTRATION_RELEASE_S = 60.0

ENGINE_ENVIRONMENT = {
    # The FlashInfer sampler JIT-compiles its top-k/top-p kernels at the first engine
    # start; greedy sampling never uses them (`kvdepot bench e2e --device cuda` turns it
    # off too).
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    # Engine processes spawned, not forked: an engine starts in a thread of this process
    # (`bounded`), and a fork copies a process with threads.
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
}
"""Read by vLLM as an engine starts (its processes inherit them then); set only while
one starts here, so the rest of a pytest session keeps its own, and never over a value
set outside."""


@contextlib.contextmanager
def engine_environment() -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in ENGINE_ENVIRONMENT}
    for name, value in ENGINE_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_STARTED = time.monotonic()
T = TypeVar("T")


def progress(line: str) -> None:
    """A progress line on stderr (shown live with `pytest -s`)."""
    print(f"[vllm-gpu +{time.monotonic() - _STARTED:.0f} s] {line}", file=sys.stderr,
          flush=True)


def bounded(what: str, seconds: float, call: Callable[[], T]) -> T:
    """`call()` in a thread of its own, waited for at most `seconds`.

    Past the limit this raises TimeoutError naming `what` and the lines the call was
    waiting in; the call itself cannot be stopped and goes on in its (daemon) thread.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"bounded: {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        frame = sys._current_frames().get(thread.ident or 0)
        where = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else ""
        raise TimeoutError(f"{what}: no answer within {seconds:.0f} s; the call was "
                           f"waiting in:\n{where}")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _engine_processes(before: set[int]) -> list[Any]:
    """The processes of an engine started after `before` (this process's children's
    pids then): its new children (vLLM's engine core) and their descendants. The kvdepot
    server, started earlier, and its copy processes are not among them."""
    import psutil

    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.pid in before or "resource_tracker" in " ".join(child.cmdline()):
                continue
            found += [child, *child.children(recursive=True)]
    return found


def _kill(processes: list[Any]) -> None:
    for process in processes:
        with contextlib.suppress(Exception):  # gone already
            process.kill()


class Engine:
    """A vLLM `LLM` whose every call is bounded; after a call ran past its limit the
    engine is given up: later calls fail at once and `close` kills its processes."""

    def __init__(self, name: str, build: Callable[[], Any]) -> None:
        import psutil

        self.name = name
        self.hung: str | None = None
        self._before = {p.pid for p in psutil.Process().children()}
        progress(f"{name}: starting (a first start on a fresh machine takes 70-100 s)")
        started = time.monotonic()
        try:
            with engine_environment():
                self.llm = bounded(f"starting {name}", ENGINE_START_S, build)
        except TimeoutError:
            _kill(_engine_processes(self._before))
            raise
        progress(f"{name}: started in {time.monotonic() - started:.0f} s")

    def call(self, what: str, seconds: float, call: Callable[[], T]) -> T:
        if self.hung is not None:
            raise RuntimeError(f"{self.name} hung earlier ({self.hung}) and is not used "
                               "again; see the first failure")
        try:
            return bounded(f"{self.name}: {what}", seconds, call)
        except TimeoutError:
            self.hung = what
            raise

    def generate(self, prompt: list[int], max_tokens: int, top_logprobs: int = 0,
                 ) -> tuple[Completion, int]:
        """One greedy request: (its completion, the prompt tokens vLLM did not compute:
        its own prefix-cache hit plus what the connector loaded)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False,
                                ignore_eos=True, logprobs=top_logprobs or None)
        (output,) = self.call(
            f"a request of {len(prompt)} tokens", REQUEST_S,
            lambda: self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params,
                                      use_tqdm=False))
        sample = output.outputs[0]
        ranked = [sorted(step.values(), key=lambda lp: lp.rank)[:top_logprobs]
                  for step in sample.logprobs or []]
        completion = Completion(list(sample.token_ids),
                                [[lp.logprob for lp in step] for step in ranked])
        return completion, int(output.num_cached_tokens or 0)

    def evict(self) -> None:
        """Empty vLLM's own prefix cache. vLLM refuses while blocks of finished requests
        are still held, which they are until kvdepot has stored them."""
        def reset() -> None:
            while not self.llm.reset_prefix_cache():
                time.sleep(0.05)

        self.call("emptying the prefix cache (waits for kvdepot's stores)", CALL_S, reset)

    def close(self) -> None:
        if self.hung is None:
            try:
                bounded(f"shutting {self.name} down", SHUTDOWN_S,
                        self.llm.llm_engine.engine_core.shutdown)
                progress(f"{self.name}: shut down")
                return
            except TimeoutError as exc:
                progress(f"{self.name}: {exc}")
        _kill(_engine_processes(self._before))
        progress(f"{self.name}: processes killed")


def make_llm(url: str, **options: Any) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(model=str(seeded_checkpoint(MODEL)), skip_tokenizer_init=True, seed=0,
               dtype="bfloat16", max_model_len=4096, enforce_eager=True, block_size=16,
               gpu_memory_utilization=0.3, enable_flashinfer_autotune=False,
               kv_transfer_config=KVTransferConfig(**kv_transfer_config(url)), **options)


class Engines:
    """The module's engines, one at a time: the connected one starts at first use."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._connected: Engine | None = None
        self._failed: str | None = None

    def connected(self) -> Engine:
        if self._failed is not None:
            raise RuntimeError(f"the engine with KVDepotConnector did not start earlier "
                               f"({self._failed}); see the first failure")
        if self._connected is None:
            try:
                self._connected = Engine("the engine with KVDepotConnector",
                                         lambda: make_llm(self.url))
            except Exception as exc:
                self._failed = f"{type(exc).__name__}: {exc}"[:300]
                raise
        return self._connected

    def close_connected(self) -> None:
        if self._connected is not None:
            engine, self._connected = self._connected, None
            engine.close()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    progress("starting kvdepot serve")
    with ServerProcess(chunk_size=CHUNK, l1_size="2GiB") as srv:
        progress(f"kvdepot serve is up at {srv.url}")
        yield srv


@pytest.fixture(scope="module")
def engines(server: ServerProcess) -> Iterator[Engines]:
    progress(f"model: {seeded_checkpoint(MODEL)}")
    engines_ = Engines(server.url)
    yield engines_
    engines_.close_connected()


def test_a_kvdepot_hit_on_the_gpu_is_vllms_own_hit(engines: Engines, server: ServerProcess
                                                   ) -> None:
    engine = engines.connected()
    rng = random.Random(3)
    length = probe_length(CHUNK, 6)
    probe, control, overwrite = (random_tokens(rng, length) for _ in range(3))
    cached: dict[str, int] = {}

    def ask(name: str, prompt: list[int], evict_first: bool) -> tuple[Completion, int]:
        if evict_first:
            engine.evict()
        if name == "kvdepot hit":
            # vLLM hands freed blocks out again with their bytes: another prompt's KV in
            # them first, so a load that wrote nothing cannot pass on the probe's.
            engine.generate(overwrite, 1)
            engine.evict()
        progress(f"correctness: {name}")
        before = server.stats()["retrieved_tokens"]
        completion, cached[name] = engine.generate(prompt, OUTPUT_TOKENS, TOP_LOGPROBS)
        return completion, int(server.stats()["retrieved_tokens"] - before)

    checked: Ask = ask
    report = check_correctness(checked, probe, control, CHUNK, exact=True)
    for line in report.lines():
        progress(line)
    assert report.failures() == [], "\n".join(report.lines())
    # vLLM's own account: the cold run computed every token; its own hit and the
    # kvdepot hit only the last one (for the kvdepot hit its prefix cache was empty, so
    # every other token came from the connector).
    assert cached == {"cold": 0, "vLLM hit": report.expected_loaded,
                      "kvdepot hit": report.expected_loaded, "control": 0}, cached


def test_vllms_own_hit_does_not_wait_for_kvdepot(engines: Engines, server: ServerProcess
                                                 ) -> None:
    """Once loads are timed, a prompt vLLM still holds is not topped up from kvdepot:
    the GPU computes its last tokens long before a load could bring them."""
    engine = engines.connected()
    rng = random.Random(4)
    for round_ in range(3):  # cold runs time the prefill, hits time the loads
        progress(f"timing round {round_ + 1} of 3")
        prompt = random_tokens(rng, 4 * CHUNK + 100)
        engine.generate(prompt, 2)  # a decode step after the prompt times the prefill
        engine.evict()
        engine.generate(prompt, 1)
    before = server.stats()["retrieves"]
    engine.generate(prompt, 1)  # vLLM holds all of it but its last block
    assert server.stats()["retrieves"] == before


def test_sleep_mode_on_this_vllm_runs_the_engine_without_kvdepot(engines: Engines,
                                                                  server: ServerProcess
                                                                  ) -> None:
    from kvdepot.integrations.vllm.connector import unexportable_kv_memory

    try:  # vLLM 0.34 allocates a sleeping engine's KV cache exportable
        from vllm.config.kv_transfer import KVCacheAccess  # noqa: F401
        exportable = True
    except ImportError:
        exportable = False
    # One engine on the GPU at a time; and the server must have let the first one's
    # registration go, or the counts below would mix the two engines.
    engines.close_connected()
    deadline = time.monotonic() + REGISTRATION_RELEASE_S
    while (registered := server.stats()["registered_engines"]) != 0:
        assert time.monotonic() < deadline, (
            f"{registered:.0f} KV cache registrations still held "
            f"{REGISTRATION_RELEASE_S:.0f} s after the engine with the connector shut down")
        time.sleep(0.5)
    before = server.stats()
    rng = random.Random(5)
    sleepy = Engine("the sleep-mode engine", lambda: make_llm(server.url,
                                                              enable_sleep_mode=True))
    try:
        refusal = unexportable_kv_memory(sleepy.llm.llm_engine.vllm_config)
        if not exportable:
            assert refusal, "this vLLM cannot share sleep-mode KV memory, yet the " \
                            "connector does not refuse it"
        prompt = random_tokens(rng, 3 * CHUNK)
        cold, _ = sleepy.generate(prompt, 8)
        progress("sleep-mode engine: sleep(level=1), then wake_up()")
        sleepy.call("sleep(level=1)", CALL_S, lambda: sleepy.llm.sleep(level=1))
        sleepy.call("wake_up()", CALL_S, sleepy.llm.wake_up)
        sleepy.evict()
        again, _ = sleepy.generate(prompt, 8)
        assert again.token_ids == cold.token_ids
        during = server.stats()  # while the engine runs: its shutdown would unregister
    finally:
        sleepy.close()
    if refusal:  # this vLLM's sleep-mode memory cannot be shared: kvdepot stays out
        for counter in ("lookups", "stores", "registered_engines"):
            assert during[counter] == before[counter], (counter, before, during)
