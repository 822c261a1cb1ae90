"""A real vLLM engine on the GPU with KVDepotConnector (vLLM 0.26 on the GPU machine).

Skips where no CUDA device or no vLLM is installed (CI has neither). A small Llama (4
layers of width 512) with seeded weights in bfloat16, chunks of 256 tokens, blocks of 16:

- a kvdepot hit is vLLM's own prefix-cache hit bit for bit (16 greedy tokens and their
  top-5 log-probabilities; in bfloat16 every hit drifts from the cold run, and both hits
  compute the prompt's last token on the same KV: `correctness.py`, exact mode), all but
  the last token loaded (by the server's counters and by vLLM's own count of the
  request's cached tokens), the worker's staging area registered beside its KV cache and no
  retrieve failing (a stage in another layout would), and a control prompt differs;
  before the kvdepot hit another prompt of the same length runs, so the hit cannot pass on
  KV left in vLLM's blocks;
- vLLM's own hit does not wait for kvdepot;
- a sleep-mode engine hits before `sleep(level=1)` and after `wake_up()`, byte-exact,
  unregistered while asleep (its KV memory is moved onto exportable memory: this vLLM
  allocates it unexportable);
- a load whose server dies before the retrieve is a load error: vLLM computes the prompt
  itself, and the output is the cold run's bit for bit;
- the first check again with the engine compiled and its CUDA graphs captured, as vLLM
  runs by default (every other engine here runs eager, as the benchmark's do with
  `--eager`).

One engine with the connector serves the first two tests; the sleep-mode test needs an
engine of its own (sleep mode is set per engine), so the first is shut down before it
starts and at most one engine holds the GPU at a time.

Every vLLM call is bounded (`tests/gpu/support/bounded_vllm.py`: an engine start 420 s,
a request 180 s, ...): past its limit the test fails naming the step and where the call
was stuck, the engine is given up and later tests fail at once. Progress goes to stderr as
`[vllm-gpu +SECONDS s] ...` lines: `pytest -s` shows them live.

Measured on an H100 with vLLM 0.26.0, 2026-12-06 15:36-15:39: the engine with the connector
started in 55 s on a fresh machine, the sleep-mode engine in 20-27 s, the one whose loads
wait in 21 s; the module took about 175 s.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

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
from tests.gpu.support.bounded_vllm import CALL_S, Engine, Progress  # noqa: E402

pytestmark = [
    pytest.mark.gpu, pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    # pytest-timeout, where installed: past every bounded wait below, so those fail first
    # with their own message.
    pytest.mark.timeout(1200),
]

CHUNK = 256
MODEL = {**SIZES["medium"], "torch_dtype": "bfloat16", "max_position_embeddings": 8192}

REGISTRATION_RELEASE_S = 60.0
progress = Progress("vllm-gpu")


def make_llm(url: str, connector: dict[str, Any] | None = None, *, eager: bool = True,
             **options: Any) -> Any:
    """The tests' engine; `eager=False` runs it as vLLM does by default on a GPU, compiled
    and with CUDA graphs captured at start."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(model=str(seeded_checkpoint(MODEL)), skip_tokenizer_init=True, seed=0,
               dtype="bfloat16", max_model_len=4096, enforce_eager=eager, block_size=16,
               gpu_memory_utilization=0.3, enable_flashinfer_autotune=False,
               kv_transfer_config=KVTransferConfig(**kv_transfer_config(url, connector)),
               **options)


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
                                         lambda: make_llm(self.url), progress)
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
    # The worker's KV cache and its staging area (vLLM schedules asynchronously here, and
    # runs its scheduler in the worker's process): the area's layout is the cache's, or
    # its stages would fail as retrieve errors and the hit would load asynchronously.
    assert server.stats()["registered_engines"] == 2
    errors = server.stats()["retrieve_errors"]
    check_a_hit_is_vllms_own_hit(engine, server, random.Random(3))
    assert server.stats()["retrieve_errors"] == errors


def check_a_hit_is_vllms_own_hit(engine: Engine, server: ServerProcess,
                                 rng: random.Random) -> None:
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


def wait_for(what: str, condition: Any) -> None:
    deadline = time.monotonic() + REGISTRATION_RELEASE_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {REGISTRATION_RELEASE_S} s"
        time.sleep(0.1)


def test_a_sleep_mode_engine_hits_before_and_after_sleeping(engines: Engines,
                                                           server: ServerProcess) -> None:
    """vLLM 0.26 with `enable_sleep_mode=True`: register, hit, `sleep(level=1)`, wake up,
    hit again, byte-exact. The sleep-mode KV memory reaches the server moved onto
    exportable memory (`cumem_sleep`); while asleep the server holds no registration of
    it (the worker unregistered before vLLM released it, so no copy can touch released
    memory); after the wake-up it is registered again and the hit loads the same bytes
    into the new memory: the same tokens and top-5 log-probabilities as before sleeping."""
    # One engine on the GPU at a time; and the server must have let the first one's
    # registration go, or the counts below would mix the two engines.
    engines.close_connected()
    wait_for("the connected engine's registration released",
             lambda: server.stats()["registered_engines"] == 0)
    rng = random.Random(5)
    prompt, overwrite = random_tokens(rng, 3 * CHUNK + 40), random_tokens(rng, 3 * CHUNK + 40)
    loaded = 3 * CHUNK + 39  # all but the last token, tail included
    sleepy = Engine("the sleep-mode engine",
                    lambda: make_llm(server.url, enable_sleep_mode=True), progress)

    def kvdepot_hit(name: str) -> Completion:
        sleepy.evict()
        sleepy.generate(overwrite, 1)  # other KV in the freed blocks first
        sleepy.evict()
        before = server.stats()["retrieved_tokens"]
        progress(f"sleep-mode engine: {name}")
        completion, cached = sleepy.generate(prompt, OUTPUT_TOKENS, TOP_LOGPROBS)
        assert cached == loaded, (name, cached)
        assert server.stats()["retrieved_tokens"] - before == loaded, name
        return completion

    try:
        assert server.stats()["registered_engines"] == 1, "the sleep-mode engine did not " \
                                                          "register"
        stored = server.stats()["stored_chunks"]
        sleepy.generate(prompt, OUTPUT_TOKENS, TOP_LOGPROBS)
        wait_for("the cold run stored", lambda: server.stats()["stored_chunks"] > stored)
        before_sleep = kvdepot_hit("hit before sleeping")
        progress("sleep-mode engine: sleep(level=1)")
        sleepy.call("sleep(level=1)", CALL_S, lambda: sleepy.llm.sleep(level=1))
        assert server.stats()["registered_engines"] == 0, "asleep, yet still registered"
        progress("sleep-mode engine: wake_up()")
        sleepy.call("wake_up()", CALL_S, sleepy.llm.wake_up)
        assert server.stats()["registered_engines"] == 1, "awake, yet not registered"
        after_wake = kvdepot_hit("hit after waking up")
    finally:
        sleepy.close()
    assert after_wake.token_ids == before_sleep.token_ids
    assert after_wake.top_logprobs == before_sleep.top_logprobs


RETRIEVE_DELAY_S = 3.0
"""The connector's test hook: how long the worker holds a load back before sending it."""


def test_a_load_whose_server_dies_is_recomputed(engines: Engines) -> None:
    """Run on an H100 with vLLM 0.26 (2026-12-06 09:58) while idle engines still loaded
    synchronously under vLLM's asynchronous scheduling: the load failed and was reported,
    yet the output's first token was not the cold run's (the request had gone on from KV
    nothing wrote). Loads are asynchronous there since (`synchronous_loads_recover`), and
    this test passed on an H100 with them (2026-12-06 15:37, with the idle-step wait)."""
    engines.close_connected()  # one engine on the GPU at a time
    rng = random.Random(6)
    prompt = random_tokens(rng, 6 * CHUNK + 17)
    with ServerProcess(chunk_size=CHUNK, l1_size="2GiB") as own:
        engine = Engine("the engine whose loads wait",
                        lambda: make_llm(own.url, {"debug.retrieve_delay_s": RETRIEVE_DELAY_S}),
                        progress)
        try:
            progress("failed load: cold")
            cold, cached = engine.generate(prompt, OUTPUT_TOKENS, TOP_LOGPROBS)
            assert cached == 0
            deadline = time.monotonic() + CALL_S
            while own.stats()["stored_chunks"] < 6:
                assert time.monotonic() < deadline, "the cold run's chunks were not stored"
                time.sleep(0.1)
            engine.evict()
            seen: dict[str, float] = {}

            def kill_after_the_lookup() -> None:
                seen.update(own.stats())  # the lookup is answered at once; the load waits
                own.kill()

            killer = threading.Timer(RETRIEVE_DELAY_S / 3, kill_after_the_lookup)
            killer.start()
            progress("failed load: the hit, the server killed while the load waits")
            again, _ = engine.generate(prompt, OUTPUT_TOKENS, TOP_LOGPROBS)
            killer.join()
        finally:
            engine.close()
    assert seen["hit_tokens"] >= 6 * CHUNK, seen  # a hit was found, and offered to vLLM
    assert seen["retrieves"] == 0, seen
    # Computed again from the start: the cold run's tokens and log-probabilities exactly.
    assert again.token_ids == cold.token_ids
    assert again.top_logprobs == cold.top_logprobs


def test_under_cuda_graphs_a_kvdepot_hit_is_vllms_own_hit(engines: Engines,
                                                         server: ServerProcess) -> None:
    """The engine as vLLM runs it by default on a GPU: compiled, with CUDA graphs (full
    graphs for decode steps, piecewise around attention for the rest). kvdepot does no work
    per layer (its layer hooks return at once), so graph replays skip nothing of its; the
    stores are copied after each step's CUDA event, as in eager mode. The same check as
    the first test: bit for bit vLLM's own hit over 16 greedy tokens, decoded in graphs."""
    engines.close_connected()  # one engine on the GPU at a time
    wait_for("the connected engine's registration released",
             lambda: server.stats()["registered_engines"] == 0)
    compiled = Engine("the compiled engine with KVDepotConnector",
                      lambda: make_llm(server.url, eager=False), progress)
    try:
        check_a_hit_is_vllms_own_hit(compiled, server, random.Random(7))
    finally:
        compiled.close()
