"""What every model family's end-to-end test checks of a hit (issue 44).

A kvdepot hit must give the output a cold run gives. On two cores in float32 a run that
reads its prefix's KV back (from kvdepot or from vLLM's own prefix cache) computes only
the rest of the prompt, so its reductions run in another order than the cold run's and
its log-probabilities move by a few 1e-6: the same greedy tokens, nearly the same values.
Bit for bit the kvdepot hit must be vLLM's own hit: both compute the same last tokens on
the same KV, so any byte the load got wrong shows.
"""

import re
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvdepot.testbed.server_process import free_port
from tests.e2e.support.harness import CHUNK, DepotServer, Engine, delta, eventually

TOP = 5
"""Log-probabilities compared per step: the sampled token's and the next most likely."""

_salts = iter(range(1 << 30))


def run(engine: Engine, prompt: list[int], salt: str | None = None) -> dict[str, Any]:
    """Eight greedy tokens with each step's top-5 log-probabilities."""
    engine.send(op="generate", prompts=[prompt], max_tokens=8, salt=salt, top_logprobs=TOP)
    return engine.receive(300)["outputs"][0]


def cold_run(engine: Engine, prompt: list[int]) -> dict[str, Any]:
    """Computed from scratch: vLLM's cache emptied, and under a salt no other run uses."""
    engine.reset_prefix_cache()
    return run(engine, prompt, salt=f"family-cold-{next(_salts)}")


def assert_close(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Greedy tokens and the top-5 token ids identical, log-probabilities within 1e-4."""
    assert actual["token_ids"] == expected["token_ids"]
    for got, want in zip(actual["top"], expected["top"], strict=True):
        assert [t for t, _ in got] == [t for t, _ in want], (got, want)
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got, want, strict=True)), (
            got, want)


def assert_differs(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The control: another prompt's output is not within the tolerance of this one's."""
    far = any(abs(x - y) > 1e-3 for sa, sb in zip(a["top"], b["top"], strict=True)
              for (_, x), (_, y) in zip(sa, sb, strict=True))
    assert a["token_ids"] != b["token_ids"] or far, "the control gave the same output"


def stored_then_hit(engine: Engine, server: DepotServer, prompt: list[int]
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, float]]:
    """Store the prompt's chunks, then answer it from vLLM's own cache and from kvdepot's
    (vLLM's emptied). Returns (vLLM's hit, kvdepot's hit, the server's counters' change
    over kvdepot's hit) as stats deltas under their names."""
    chunks = len(prompt) // CHUNK
    engine.reset_prefix_cache()
    before = server.stats()
    run(engine, prompt)
    eventually(server, lambda s: delta(s, before, "stored_chunks") == chunks)
    own = run(engine, prompt)  # vLLM's own prefix cache holds the whole chunks
    # A reset forgets blocks but keeps their bytes, and vLLM hands the same blocks out
    # again: another prompt of the same length overwrites them, so a load that wrote
    # nothing (or wrote elsewhere) cannot pass on the KV left behind.
    engine.reset_prefix_cache()
    run(engine, [t + 1 for t in prompt], salt=f"family-overwrite-{next(_salts)}")
    engine.reset_prefix_cache()  # only kvdepot can serve it now
    before = server.stats()
    hit = run(engine, prompt)
    after = server.stats()
    counters = {name: float(delta(after, before, name))
                for name in ("retrieved_chunks", "retrieve_errors", "hit_tokens")}
    return own, hit, counters


def endpoint_ports() -> tuple[int, int]:
    """Ports for a server's admin API and Prometheus endpoint."""
    return free_port(), free_port()


@contextmanager
def server_with_endpoints(log_dir: Path, ports: tuple[int, int], **options: Any
                          ) -> Iterator[DepotServer]:
    """A started server whose admin API and Prometheus endpoint listen on `ports`
    (`options`: `DepotServer`'s); killed on exit."""
    admin, metrics = ports
    depot = DepotServer(log_dir, extra=("--admin-port", str(admin),
                                        "--metrics-port", str(metrics)), **options)
    depot.start()
    try:
        yield depot
    finally:
        depot.kill()


def group_gauge(metrics_port: int, name: str) -> list[tuple[str, str]]:
    """Each sample of Prometheus gauge `kvdepot_<name>` as (its group label, its value)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return re.findall(rf'^kvdepot_{name}\{{.*group="(\d)".*\}} (\S+)$', text, re.MULTILINE)
