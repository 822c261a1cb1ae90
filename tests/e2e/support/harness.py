"""What the end-to-end tests share: a real `kvdepot serve` and real vLLM engines.

Every engine runs `engine_driver.py` (beside this file) in its own process; the tests
talk to it over JSON lines. The model is a small Llama with seeded random weights
(`kvdepot.testbed.checkpoint`, written once and cached), so nothing is downloaded.
The suite's fixtures (tests/e2e/conftest.py) start the servers and write the model.
"""

import itertools
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvdepot.testbed.checkpoint import SIZES
from kvdepot.testbed.server_process import free_port
from kvdepot.testbed.vllm_engine import random_tokens
from tests.support.server import ForkedServerProcess

CHUNK = 256
BLOCK = 128
ENGINE_DRIVER = Path(__file__).with_name("engine_driver.py")
"""The script each engine process runs (by path: it imports nothing of the tests)."""
ENGINE_START_TIMEOUT = 420.0

MODEL_CONFIG = SIZES["small"]

# For tests that take a hit's chunks away before its load runs (`short_lock_server`, and
# engines with `debug__retrieve_delay_s=RETRIEVE_DELAY_S`): each batch of retrieves waits
# RETRIEVE_DELAY_S (the connector's test hook), and lookup locks expire after LOCK_TTL_S.
# The server expires locks on a once-a-second pass and the test polls its counters before
# clearing, so the delay leaves several seconds past the TTL for that on a loaded machine.
RETRIEVE_DELAY_S = 6.0
LOCK_TTL_S = 1

_cold_runs = itertools.count()


def tokens(seed: int, n: int) -> list[int]:
    """A reproducible prompt."""
    return random_tokens(random.Random(seed), n)


class DepotServer(ForkedServerProcess):
    """`kvdepot serve` (forked from the tests' fork server, `tests/support/server.py`) that
    a test can kill and start again; `options`: more of `ServerProcess`'s (lock_ttl, ...)."""

    def __init__(self, log_dir: Path, port: int | None = None, chunk_size: int = CHUNK,
                 **options: Any) -> None:
        port = port or free_port()
        super().__init__(port=port, chunk_size=chunk_size, l1_size="1GiB",
                         output=log_dir / f"server-{port}.log", **options)


class Engine:
    """One vLLM engine process running engine_driver.py with KVDepotConnector (without any
    connector if `connector` is False: a reference run)."""

    def __init__(self, model_dir: Path, url: str, log_path: Path, kv_role: str = "kv_both",
                 llm_kwargs: dict[str, Any] | None = None, wait: bool = True,
                 connector: bool = True, **extra: Any) -> None:
        extra_config = {"kvdepot.url": url, "kvdepot.heartbeat_interval": 1.0,
                        "kvdepot.lookup_timeout": 2.0}
        extra_config.update({"kvdepot." + k.replace("__", "."): v for k, v in extra.items()})
        settings = {"model": str(model_dir), "kv_role": kv_role, "extra_config": extra_config,
                    "llm_kwargs": llm_kwargs or {}, "connector": connector}
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="1")
        read_fd, write_fd = os.pipe()
        settings["reply_fd"] = write_fd
        self._log = open(log_path, "wb")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, str(ENGINE_DRIVER), json.dumps(settings)],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
            text=True, env=env, pass_fds=(write_fd,),
        )
        os.close(write_fd)
        self._exit_sent = False
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(read_fd,), daemon=True).start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until vLLM is up (start several engines with wait=False to overlap)."""
        self.receive(ENGINE_START_TIMEOUT)

    def _pump(self, read_fd: int) -> None:
        with os.fdopen(read_fd) as replies:
            for line in replies:
                self._replies.put(json.loads(line))
        self._replies.put(None)

    def send(self, **cmd: Any) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(cmd) + "\n")
        self._proc.stdin.flush()

    def receive(self, timeout: float = 300.0) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"engine gave no answer within {timeout} s; see {self._log.name}"
                               ) from None
        if reply is None:
            raise RuntimeError(f"engine process exited; see {self._log.name}")
        return reply

    def generate(self, prompts: list[list[int]], max_tokens: int = 8, salt: str | None = None,
                 timeout: float = 300.0) -> list[dict[str, Any]]:
        self.send(op="generate", prompts=prompts, max_tokens=max_tokens, salt=salt)
        return self.receive(timeout)["outputs"]

    def metrics(self) -> dict[str, float]:
        self.send(op="metrics")
        return self.receive()["metrics"]

    def reset_prefix_cache(self) -> None:
        self.send(op="reset_prefix_cache")
        assert self.receive()["ok"], "vLLM refused to reset its prefix cache"

    def begin_close(self) -> None:
        """Ask the engine to exit without waiting (`close_engines` shuts several down at
        once: vLLM takes seconds to stop)."""
        if self._proc.poll() is None and not self._exit_sent:
            try:
                self.send(op="exit")
                self._exit_sent = True
            except Exception:
                self._proc.kill()

    def close(self) -> None:
        self.begin_close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=30)
        self._log.close()


def close_engines(*engines: Engine) -> None:
    for engine in engines:
        engine.begin_close()
    for engine in engines:
        engine.close()


def assert_same_output(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Greedy tokens identical, and their log-probabilities equal up to float32 noise.

    A run that reads its KV back from kvdepot or from vLLM's own prefix cache differs
    from the cold run by a few 1e-6 here; one wrong KV block moves them far more.
    """
    assert actual["token_ids"] == expected["token_ids"]
    for got, want in zip(actual["logprobs"], expected["logprobs"], strict=True):
        assert abs(got - want) < 1e-4, (actual["logprobs"], expected["logprobs"])


def eventually(server: DepotServer, condition: Callable[[dict[str, float]], bool],
               timeout: float = 20.0) -> dict[str, float]:
    """The server's stats once `condition` holds (stores land after vLLM returns)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if condition(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"server stats never satisfied the condition: {stats}")
        time.sleep(0.1)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> int:
    return int(after[name] - before[name])


def cold(engine: Engine, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    """The reference output: computed from scratch (vLLM's prefix cache reset, and under a
    salt no other run uses, so kvdepot holds nothing for it)."""
    engine.reset_prefix_cache()
    return engine.generate([prompt], max_tokens, salt=f"cold-{next(_cold_runs)}")[0]
