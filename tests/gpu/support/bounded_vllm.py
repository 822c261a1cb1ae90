"""A real vLLM engine whose every call is waited for at most a set time (GPU test helper).

vLLM's `LLM` calls wait without a limit: an engine that never starts, or a request whose
KV load never completes, would hang a test with no output. Here each call runs in a
thread of its own (`bounded`); past its limit the test fails naming the step and where the
call was stuck, and the engine is given up: later calls fail at once and `close` kills its
processes. `Progress` prints timestamped lines on stderr (`pytest -s` shows them live).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from kvdepot.testbed.vllm_engine import Completion

ENGINE_START_S = 420.0
"""The first start on a fresh machine takes 30-100 s; several times that is a hang."""
REQUEST_S = 180.0
"""A request of a few thousand tokens on the tests' small models takes well under a
second; the first ones after a start may compile a few Triton kernels."""
CALL_S = 120.0
"""Other engine calls: resetting the prefix cache, reading metrics, sleep, wake-up."""
SHUTDOWN_S = 120.0

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

T = TypeVar("T")


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


class Progress:
    """Progress lines on stderr, `[TAG +SECONDS s] ...`, seconds since it was made."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._started = time.monotonic()

    def __call__(self, line: str) -> None:
        print(f"[{self.tag} +{time.monotonic() - self._started:.0f} s] {line}",
              file=sys.stderr, flush=True)


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
    """A vLLM `LLM` built by `build`, whose every call is bounded; after a call ran past
    its limit the engine is given up: later calls fail at once and `close` kills its
    processes."""

    def __init__(self, name: str, build: Callable[[], Any], progress: Progress) -> None:
        import psutil

        self.name = name
        self.progress = progress
        self.hung: str | None = None
        self._before = {p.pid for p in psutil.Process().children()}
        progress(f"{name}: starting (a first start on a fresh machine takes 30-100 s)")
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
                self.progress(f"{self.name}: shut down")
                return
            except TimeoutError as exc:
                self.progress(f"{self.name}: {exc}")
        _kill(_engine_processes(self._before))
        self.progress(f"{self.name}: processes killed")
