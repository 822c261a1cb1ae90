"""`kvdepot bench e2e --device cuda`: time to first token of a real vLLM engine on a GPU.

The model has Llama-3.1-8B's shape (32 layers by default) with seeded weights written on
the machine (`checkpoint.py`), in bfloat16. Each engine runs in a fresh process, one after
the other, on the same GPU and the same prompts, compiled with CUDA graphs as vLLM runs by
default on a GPU (`--eager`: every engine eager):

  none      no connector: cold, and vLLM's own prefix-cache hit (the same prompt again);
  kvdepot   KVDepotConnector: cold, vLLM's own hit (vLLM still holds the prompt: kvdepot
            must not slow it down), and kvdepot's hit after vLLM's prefix cache was
            emptied; then the correctness check with its control, and throughput;
  offload   vLLM's own CPU offload (`OffloadingConnector`, `kv_offloading_size`): cold,
            its hit after the prefix cache was emptied;
  lmcache   LMCache 0.5.6's multiprocess server (`python -m
            lmcache.v1.multiprocess.http_server`, what `lmcache server` runs), started for
            this engine with as much CPU memory as kvdepot gets, through vLLM's in-tree
            `LMCacheMPConnector` with failed loads recomputed (as kvdepot sets vLLM): cold,
            its hit after the prefix cache was emptied, timed as `offload`. If its server
            or its CUDA operations fail on this machine, the reason (the exception, the
            tails of its server's and vLLM's logs) is recorded for it and the other
            engines run on; if its CUDA extension does not load (it then copies with
            torch operations), the report says so beside its figures;
  kvdepot-async  KVDepotConnector with `kvdepot.inline_loads` off: every load
            asynchronous and never waited for; its hit beside kvdepot's shows what an idle
            engine's synchronous loads (vLLM scheduling in turn) or waits within the step
            (vLLM's asynchronous scheduling, the GPU default) save (the server already
            holds the prompts);
  noop      a connector that does nothing (`noop_connector.py`): cold and vLLM's own
            hit, which with it is what vLLM's connector plumbing alone costs a step.

Each connector's hit is shown like `offload`'s: its median, and its ratio to the floor.
Every engine times vLLM's own hit right after the cold run (a connector may still be
copying the cold run's KV to its CPU memory meanwhile); none, noop and kvdepot time it again
once that is done (`_let_stores_finish`): what a connector costs a step on its own.

The floor of a hit from CPU memory is vLLM's own hit plus the prompt's KV bytes at the
host-to-device rate, measured in this run with pinned memory before any engine starts.

`--own-hit-rounds N` runs the engines named at once instead, their own hits taken in turn
(`own_hit_rounds.py`): what a connector costs vLLM's own hit, free of the host's drift.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdepot.testbed.measurement import in_spawned_process, machine, server_process

if TYPE_CHECKING:
    from kvdepot.client.admin import AdminClient

ENGINES = ("none", "kvdepot", "offload", "lmcache", "kvdepot-async", "noop")
KVDEPOT_ENGINES = ("kvdepot", "kvdepot-async")
"""KVDepotConnector as it ships, and with `inline_loads` off: what an idle engine's
synchronous loads, or its waits for asynchronous ones, save, measured in the same run."""
ROUNDS_ENGINES = ("none", "noop", "kvdepot", "kvdepot-async", "offload")
"""The engines `--own-hit-rounds` runs side by side (LMCache needs a server of its own per
engine)."""
CHUNK_SIZE = 256
BLOCK_SIZE = 16
"""vLLM's block size on CUDA (FlashAttention's default)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--device cuda")
    g.add_argument("--layers", type=int, default=32,
                   help="layers of the Llama-3.1-8B-shaped model (default %(default)s)")
    g.add_argument("--prompt-lengths", default="8192,2048,32768",
                   help="prompt lengths in tokens, in the order run; the first one's first "
                        "kvdepot hit is the engine's first retrieve (default %(default)s)")
    g.add_argument("--engines", default=",".join(ENGINES),
                   help="which engines to run, of " + ", ".join(ENGINES))
    g.add_argument("--l1-size", default="32GiB",
                   help="the server's CPU memory, in GiB; offload and lmcache get as much")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    g.add_argument("--lmcache-start-timeout", type=float, default=300.0,
                   help="seconds LMCache's server may take to answer its health check (it "
                        "pins its whole CPU memory first; default %(default)s)")
    g.add_argument("--lmcache-timeout", type=float, default=600.0,
                   help="seconds the lmcache engine may run in all, start to throughput; "
                        "past it the engine is stopped and the run goes on (default "
                        "%(default)s)")
    g.add_argument("--own-hit-rounds", type=int, default=0, metavar="N",
                   help="instead of the run above: the engines named (of "
                        + ", ".join(ROUNDS_ENGINES) + ") all at once, N rounds of each "
                        "one's own hit of each prompt in turn (`own_hit_rounds.py`); each "
                        "engine gets an equal share of --gpu-memory-utilization and must hold "
                        "every prompt (on 80 GB, three engines: --prompt-lengths 8192,2048)")
    g.add_argument("--eager", dest="cuda_graphs", action="store_false",
                   help="run every engine eager (vLLM's enforce_eager) instead of as vLLM "
                        "runs by default on a GPU, compiled with CUDA graphs captured as it "
                        "starts: shorter starts, and a short step's time is then its host "
                        "CPU's launching kernels")
    g.add_argument("--json", type=Path, default=None, help="also write every figure here")


def execution_mode(args: argparse.Namespace) -> str:
    """How the engines run, as the headers say it."""
    return "compiled with CUDA graphs" if args.cuda_graphs else "eager"


def _model_dir(layers: int) -> Path:
    import torch

    from kvdepot.testbed.checkpoint import LLAMA_8B_CONFIG, seeded_checkpoint

    folder = seeded_checkpoint({**LLAMA_8B_CONFIG, "num_hidden_layers": layers}, device="cuda")
    torch.cuda.empty_cache()  # the engines size their memory from what is free
    return folder


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    """K and V of every layer, bfloat16."""
    return (config["num_hidden_layers"] * 2 * config["num_key_value_heads"]
            * config["head_dim"] * 2)


def host_to_device_rate(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second from pinned host memory to the GPU: the best of `repeats` of
    one whole copy, and of the same bytes in 64 MiB pieces on two streams in turn (the
    way a copy engine is kept busy); the higher is the link's limit."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    piece = 64 << 20

    def whole() -> None:
        device.copy_(host, non_blocking=True)

    def pieces() -> None:
        for i, at in enumerate(range(0, nbytes, piece)):
            with torch.cuda.stream(streams[i % 2]):
                device[at:at + piece].copy_(host[at:at + piece], non_blocking=True)

    best = float("inf")
    for copy in (whole, pieces):
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    return nbytes / best


def engine_options(engine: str, url: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM(...)` arguments that make `engine` the engine it names."""
    from vllm.config import KVTransferConfig

    from kvdepot.testbed.vllm_engine import kv_transfer_config, lmcache_transfer_config

    options: dict[str, Any] = {}
    if engine in KVDEPOT_ENGINES:
        assert url is not None
        options["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config(
            url, {"inline_loads": engine == "kvdepot"}))
    elif engine == "offload":
        # As much CPU memory as kvdepot gets.
        options["kv_offloading_size"] = gib(args.l1_size)
        options["kv_offloading_backend"] = "native"
    elif engine == "noop":
        options["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NoopConnector", kv_role="kv_both",
            kv_connector_module_path="kvdepot.bench.noop_connector")
    elif engine == "lmcache":
        # The server's memory and chunk size are set where it starts (`_run_lmcache`). A
        # failed load is recomputed, as kvdepot has vLLM do for its own: under vLLM's
        # default policy one failed load fails its request and then the engine (0.26).
        options["kv_transfer_config"] = KVTransferConfig(
            **lmcache_transfer_config(args.lmcache_port), kv_load_failure_policy="recompute")
    return options


WARM_TOKENS = 4097
"""The length of each engine's first request (`warm_up`)."""


def max_model_len(lengths: list[int]) -> int:
    """What an engine must take: the longest prompt or the warm-up, and a few tokens more."""
    return max(*lengths, WARM_TOKENS) + 256


def warm_up(llm: Any, rng: random.Random) -> None:
    """First-call overheads; decoding after the prompt times the engine's prefill rate,
    which the connector weighs loads against. The same prompt again is vLLM's own hit
    computing one token after a long prefix, as every hit after it does: vLLM's first
    computation of that shape is slower than later ones whatever the KV's source
    (docs/benchmarks.md), and that is vLLM's, not the first load's."""
    from kvdepot.testbed.vllm_engine import generate, random_tokens

    warm = random_tokens(rng, WARM_TOKENS)
    generate(llm, [warm], 8)
    generate(llm, [warm], 1)


def cuda_device_name() -> str | None:
    """The GPU's name, with vLLM's environment set for it; None (and why, printed) where
    there is none."""
    import torch

    if not torch.cuda.is_available():
        print("kvdepot bench e2e --device cuda: no CUDA device here")
        return None
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return str(torch.cuda.get_device_name())


def llm_options(model_dir: Path, engine: str, url: str | None, max_len: int,
                args: argparse.Namespace) -> dict[str, Any]:
    """Every `LLM(...)` argument of `engine`: the model and the run's, then the engine's."""
    return {"model": str(model_dir), "skip_tokenizer_init": True, "seed": 0,
            "dtype": "bfloat16", "max_model_len": max_len,
            "enforce_eager": not args.cuda_graphs, "block_size": BLOCK_SIZE,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "disable_log_stats": False, **engine_options(engine, url, args)}


def _make_llm(model_dir: Path, engine: str, url: str | None, max_len: int,
              args: argparse.Namespace) -> Any:
    from vllm import LLM

    return LLM(**llm_options(model_dir, engine, url, max_len, args))


def _timed(llm: Any, prompt: list[int]) -> tuple[float, dict[str, float], int, int | None]:
    """One request for one greedy token: (wall seconds, the engine's own phase times in
    ms where it reports them, the token, the prompt tokens vLLM did not compute: its own
    prefix-cache hit plus what a connector loaded, None where it does not say)."""
    from vllm import SamplingParams, TokensPrompt

    start = time.perf_counter()
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                             SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                            ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - start
    phases: dict[str, float] = {}
    stats = getattr(output, "metrics", None)
    if stats is not None and getattr(stats, "scheduled_ts", 0):
        # Queued to scheduled: the lookup and any load; scheduled to first token: compute.
        phases = {"waiting_ms": (stats.scheduled_ts - stats.queued_ts) * 1e3,
                  "running_ms": (stats.first_token_ts - stats.scheduled_ts) * 1e3}
    return wall, phases, output.outputs[0].token_ids[0], getattr(output, "num_cached_tokens", None)


STORES_SETTLE_S = 0.5
"""How long every engine pauses before the settled own hit: a connector's stores of the
cold run (1 GiB at 8,192 tokens) are done well within it, and an engine without kvdepot
pauses as long, so the pause itself counts the same everywhere."""


SETTLED_OWN_HIT_ENGINES = ("none", "noop", "kvdepot", "kvdepot-async")
"""The engines whose settled own hit is timed: the ones it is compared between. Not the
peers: LMCache 0.5.6 loads on vLLM's own hit once it holds the prompt; that load failed on
an H100 (and vLLM's default policy ended the engine), and on an H200, with failed loads
recomputed, none of its hits in that engine loaded anything (docs/benchmarks.md)."""


SETTLED_REPEATS = 5
"""Times the settled own hit is run, its median kept: a connector's cost per step is read
from it (about a millisecond), and one run on a busy host varies by more than that."""


def _timed_median(llm: Any, prompt: list[int], times: int) -> tuple[float, dict[str, float]]:
    """`_timed` run `times` times: the median wall seconds and the median of each phase
    every run reported."""
    runs = [_timed(llm, prompt) for _ in range(times)]
    phases = {key: statistics.median(run[1][key] for run in runs)
              for key in runs[0][1] if all(key in run[1] for run in runs)}
    return statistics.median(run[0] for run in runs), phases


def _let_stores_finish(admin: AdminClient | None) -> None:
    """Pause `STORES_SETTLE_S`, then, where kvdepot serves, wait (at most 10 s more) until
    its server has no transfer in flight."""
    time.sleep(STORES_SETTLE_S)
    deadline = time.monotonic() + 10.0
    while admin is not None and admin.stats().get("transfers_in_flight", 0) > 0:
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)


def _evict(llm: Any) -> None:
    from kvdepot.testbed.vllm_engine import evict_local_cache

    evict_local_cache(llm)


def _measure_prompt(llm: Any, engine: str, prompt: list[int],
                    admin: AdminClient | None) -> dict[str, Any]:
    """One prompt's row: cold, vLLM's own hit, where it is compared the settled own hit,
    and where the engine has a connector that loads, its hit after vLLM's prefix cache was
    emptied."""
    row: dict[str, Any] = {}
    _evict(llm)
    row["cold"], row["cold_phases"], cold_token, _ = _timed(llm, prompt)
    row["vllm_hit"], row["vllm_hit_phases"], token, _ = _timed(llm, prompt)
    row["vllm_hit_same"] = token == cold_token
    if engine in SETTLED_OWN_HIT_ENGINES:
        # Right after the cold run its KV may still be on its way to a connector's CPU
        # memory, copies beside the hit's compute; once they are done, the hit again: what
        # the connector costs a step on its own.
        _let_stores_finish(admin)
        row["vllm_hit_settled"], row["vllm_hit_settled_phases"] = _timed_median(
            llm, prompt, SETTLED_REPEATS)
    if engine not in ("none", "noop"):
        _evict(llm)
        before = admin.stats() if admin else {}
        # vLLM's prefix cache is empty: what it did not compute, the connector loaded (the
        # one measure of a load that every connector gives).
        row["hit"], row["hit_phases"], token, row["hit_cached_tokens"] = _timed(llm, prompt)
        if admin is not None:
            after = admin.stats()
            row["loaded"] = int(after["retrieved_tokens"] - before["retrieved_tokens"])
            # The server's own time on the hit's retrieves, copies included.
            row["hit_phases"]["server_retrieve_ms"] = 1e3 * (
                after.get("retrieve_seconds", 0) - before.get("retrieve_seconds", 0))
        row["hit_same"] = token == cold_token
    return row


def _engine_run(model_dir: Path, engine: str, url: str | None, args: argparse.Namespace,
                log_path: Path, out: Any) -> None:
    from kvdepot.testbed.vllm_engine import (
        quiet_vllm_logging,
        random_tokens,
        stderr_to,
        throughput,
    )

    quiet_vllm_logging()
    lengths = [int(n) for n in args.prompt_lengths.split(",")]
    started = time.perf_counter()
    with stderr_to(log_path):
        llm = _make_llm(model_dir, engine, url, max_model_len(lengths), args)
        result: dict[str, Any] = {"start_s": time.perf_counter() - started, "ttft": {}}
        if engine == "lmcache":  # importing lmcache logs at INFO: into vLLM's log too
            result["connector_class"] = _lmcache_connector_class()
    print(f"  [{engine}] engine started in {result['start_s']:.0f} s"
          + (f"; connector {result['connector_class']}" if "connector_class" in result else ""),
          flush=True)
    admin: AdminClient | None = None
    try:
        if url is not None:
            from kvdepot.client.admin import AdminClient

            admin = AdminClient(url)
        rng = random.Random(1)  # the same prompts in every engine
        warm_up(llm, rng)
        for length in lengths:
            rows: list[dict[str, Any]] = []
            for _ in range(args.prompts):
                row = _measure_prompt(llm, engine, random_tokens(rng, length), admin)
                rows.append(row)
                print(f"  [{engine}] {length} tokens: " + ", ".join(
                    f"{k} {v * 1e3:.1f} ms" for k, v in row.items()
                    if k in ("cold", "vllm_hit", "hit")), flush=True)
            result["ttft"][length] = rows
        if engine == "kvdepot" and admin is not None:
            result["correctness"] = _correctness(llm, admin, rng, lengths[0])
        if engine != "kvdepot-async":  # no load without reuse; noop: vLLM's plumbing
            result["throughput"] = throughput(llm, args.throughput_prompts,
                                              args.throughput_tokens, args.output_tokens,
                                              args.repeats, seed=7)
    finally:
        if admin is not None:
            admin.close()
        llm.llm_engine.engine_core.shutdown()
    out.put(result)


# --- LMCache ---------------------------------------------------------------------------
# For a like-for-like comparison with kvdepot: the same chunk size (256 tokens, LMCache's
# default too; the connector loads and stores whole chunks of 16 vLLM blocks), as much CPU
# memory as kvdepot's --l1-size, allocated and pinned whole at start (`--no-l1-use-lazy`,
# as kvdepot allocates its L1 once; LMCache's default grows it from 20 GB during stores),
# LRU eviction (required; it starts at 0.8 of the memory, above the ~16 GiB the TTFT
# prompts take at 32 layers), and everything else at LMCache's defaults: one GPU copy
# worker, blake3 chunk hashes, the ZeroMQ transport, its metrics on. Its usage telemetry is
# off (the machine has no network). LMCache stores and loads whole chunks only: a hit on a
# prompt of a multiple of 256 tokens loads one chunk less than the prompt (vLLM computes
# at least its last token) and computes those 256 tokens; "hit_cached_tokens" shows it.
# vLLM 0.26's `LMCacheMPConnector` is the class lmcache ships
# (lmcache.integration.vllm.lmcache_mp_connector) unless LMCACHE_USE_UPSTREAM_MP is set or
# that fails to import; the result names the one used ("connector_class").

LMCACHE_SERVER_MODULE = "lmcache.v1.multiprocess.http_server"
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
LMCACHE_WITHOUT_CUDA_OPS = "lmcache.cuda_ops compiled extension not found"
"""What LMCache logs when its CUDA extension does not import (and it copies with torch
operations instead): on torch 2.11 its `cuda_ops` lacks a symbol (docs/benchmarks.md)."""


class LMCacheUnavailable(RuntimeError):
    """LMCache's server or engine could not run here; the message says why."""


def gib(size: str) -> float:
    """"32GiB" -> 32.0 (the form --l1-size takes here)."""
    return float(size.removesuffix("GiB"))


def parse_engines(text: str) -> list[str]:
    """The --engines list, in its order; ValueError names any unknown one."""
    engines = [e.strip() for e in text.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise ValueError(f"unknown engines {unknown}; choose from {', '.join(ENGINES)}")
    return engines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lmcache_server_command(port: int, http_port: int, l1_gib: float,
                           chunk_size: int = CHUNK_SIZE) -> list[str]:
    """LMCache's multiprocess server with its HTTP front end (the health check), both on
    127.0.0.1; its L1 (CPU memory) `l1_gib` GiB, pinned at start."""
    return [sys.executable, "-m", LMCACHE_SERVER_MODULE,
            "--host", "127.0.0.1", "--port", str(port),
            "--http-host", "127.0.0.1", "--http-port", str(http_port),
            "--chunk-size", str(chunk_size),
            "--l1-size-gb", f"{l1_gib:g}", "--no-l1-use-lazy", "--eviction-policy", "LRU"]


def log_mentions(path: Path, text: str) -> bool:
    """Whether the log at `path` holds `text` (False if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return text.encode() in f.read()
    except OSError:
        return False


def log_tail(path: Path, start: int = 0, chars: int = 6000, head: int = 0) -> str:
    """The last `chars` bytes of `path` written after byte `start` ("" if none), after its
    first `head` bytes from `start` when there are more (a cause logged early, such as a
    failed import of LMCache's CUDA extension, stays in sight of the traceback at the end)."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            if end - start <= head + chars:
                f.seek(start)
                return f.read().decode("utf-8", "replace")
            f.seek(start)
            first = f.read(head).decode("utf-8", "replace")
            f.seek(end - chars)
            last = f.read().decode("utf-8", "replace")
            return f"{first}\n[...]\n{last}" if head else last
    except OSError:
        return ""


class LMCacheServer:
    """LMCache's server as a child process, its output in `log_path`; the context is
    entered once `health_url` answers 200, and left with it stopped (SIGTERM, then SIGKILL
    to it and anything it started, 30 s later). It stays in this process's session, so
    whatever ends the bench's session ends it too: none outlives the run pinning memory."""

    def __init__(self, command: Sequence[str], health_url: str, log_path: Path,
                 start_timeout: float) -> None:
        self.command = list(command)
        self.health_url = health_url
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s = 0.0

    def __enter__(self) -> LMCacheServer:
        started = time.perf_counter()
        with open(self.log_path, "wb") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **LMCACHE_ENV, "PYTHONUNBUFFERED": "1"})
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - started
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self.proc is not None
        # No proxy: the health check is on this machine.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + self.start_timeout
        while True:
            status = self.proc.poll()
            if status is not None:
                raise LMCacheUnavailable(
                    f"LMCache's server exited with status {status} before it was ready "
                    f"({' '.join(self.command)}); its output:\n"
                    + log_tail(self.log_path, head=3000))
            try:
                with opener.open(self.health_url, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise LMCacheUnavailable(
                    f"LMCache's server did not answer {self.health_url} within "
                    f"{self.start_timeout:g} s (--lmcache-start-timeout); its output:\n"
                    + log_tail(self.log_path, head=3000))
            time.sleep(0.25)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        import psutil

        try:
            others = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            others = []
        proc.send_signal(signal.SIGTERM)  # uvicorn's graceful shutdown closes LMCache
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        for p in others:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def _lmcache_connector_class() -> str:
    """Which class vLLM's `LMCacheMPConnector` name resolved to in this environment."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import lmcache_mp_connector

        cls = lmcache_mp_connector.LMCacheMPConnector
        return f"{cls.__module__}.{cls.__qualname__}"
    except Exception as exc:  # only a label: the engine itself already started
        return f"unknown ({type(exc).__name__}: {exc})"


def _lmcache_engine_run(model_dir: Path, port: int, args: argparse.Namespace, log_path: Path,
                        out: Any) -> None:
    """`_engine_run` for the lmcache engine; any error goes back on `out` as its
    traceback ({"error": ...}) instead of ending the run."""
    os.environ.update(LMCACHE_ENV)  # before vLLM starts its engine core, which inherits it
    try:
        _engine_run(model_dir, "lmcache", None, argparse.Namespace(**vars(args), lmcache_port=port),
                    log_path, out)
    except BaseException:
        out.put({"error": traceback.format_exc()})


def _run_lmcache(model_dir: Path, args: argparse.Namespace, vllm_log: Path,
                 command: Sequence[str] | None = None,
                 engine: Callable[..., None] = _lmcache_engine_run) -> dict[str, Any]:
    """Start LMCache's server, run the lmcache engine against it, stop the server. Never
    raises: a failure is the result's "error" (the exception or the engine's traceback),
    with the tails of the server's output and of what vLLM logged meanwhile."""
    server_log = Path(tempfile.gettempdir()) / f"kvdepot-bench-lmcache-server-{os.getpid()}.log"
    vllm_log_start = vllm_log.stat().st_size if vllm_log.exists() else 0
    result: dict[str, Any] = {"server_log": str(server_log)}
    print(f"  [lmcache] starting LMCache's server (its output: {server_log})", flush=True)
    try:
        port, http_port = free_port(), free_port()
        if command is None:
            command = lmcache_server_command(port, http_port, gib(args.l1_size))
        result["server_command"] = list(command)
        with LMCacheServer(command, f"http://127.0.0.1:{http_port}/healthcheck", server_log,
                           args.lmcache_start_timeout) as server:
            result["server_start_s"] = server.start_s
            print(f"  [lmcache] server ready in {server.start_s:.0f} s", flush=True)
            got = in_spawned_process(engine, model_dir, port, args, vllm_log,
                                     timeout=args.lmcache_timeout)
        if "error" in got:
            raise LMCacheUnavailable(got["error"])
        result.update(got)
        result["cuda_ops"] = not log_mentions(server_log, LMCACHE_WITHOUT_CUDA_OPS)
        if not result["cuda_ops"]:
            print("  [lmcache] its CUDA extension did not load: it copied with torch operations "
                  f"(its log: {LMCACHE_WITHOUT_CUDA_OPS!r})", flush=True)
    except Exception as exc:
        reason = str(exc) if isinstance(exc, LMCacheUnavailable) else (
            f"{type(exc).__name__}: {exc}")
        result["error"] = reason
        result["server_log_tail"] = log_tail(server_log, head=3000)
        result["vllm_log_tail"] = log_tail(vllm_log, vllm_log_start)
        last = [line for line in reason.strip().splitlines() if line.strip()]
        print(f"  [lmcache] FAILED, recorded in the results; the other engines go on: "
              f"{last[-1] if last else reason}", flush=True)
    return result


def _bytes_ms(length: int, per_token: int, rate: float) -> float:
    """The floor's second part: a prompt's KV bytes at the host-to-device rate, in ms."""
    return length * per_token / rate * 1e3


def _floor_from_own_hits(rows_by_length: dict[int, list[dict[str, Any]]],
                         summary: dict[str, Any], rate: float, per_token: int,
                         lengths: list[int], field: str, label: str) -> None:
    """Another reading of the floor, printed under the table as "the floor from `label`":
    the median of every own hit in `rows_by_length` (right after each cold run and, where
    timed, again later: `vllm_hit_settled`) plus the bytes, kept as `field` of each
    length's summary beside kvdepot's hit ratio to it.

    Two are read. Every own hit of the no-connector engine: it times each prompt's own hit
    twice, the same quantity both times, and a median of as few hits as there are prompts
    (the table's floor) moves with the host's noise. The kvdepot engine's own hits: each
    engine is a fresh process started minutes apart, and on one host their own hits of
    the same prompts differed by up to 7.5 ms at 8,192 tokens; against its own engine's
    pace a hit's ratio counts only what the load adds (docs/benchmarks.md)."""
    parts = []
    for length in lengths:
        rows = rows_by_length.get(length) or []
        own = [r[key] for r in rows for key in ("vllm_hit", "vllm_hit_settled") if key in r]
        line = summary["lengths"][length]
        if not own or "kvdepot_hit" not in line:
            continue
        floor = statistics.median(own) * 1e3 + _bytes_ms(length, per_token, rate)
        line[field] = floor
        parts.append(f"{length}: {floor:.1f} ms, kvdepot {line['kvdepot_hit'] / floor:.2f}x")
    if parts:
        print(f"the floor from {label}: " + "; ".join(parts))


def _correctness(llm: Any, admin: AdminClient, rng: random.Random, length: int) -> list[str]:
    from kvdepot.testbed.correctness import check_correctness, engine_ask, probe_length
    from kvdepot.testbed.vllm_engine import random_tokens

    probe = probe_length(CHUNK_SIZE, max(1, length // CHUNK_SIZE - 1))
    # bfloat16: the kvdepot hit is held to vLLM's own hit bit for bit (correctness.py).
    report = check_correctness(engine_ask(llm, admin), random_tokens(rng, probe),
                               random_tokens(rng, probe), CHUNK_SIZE, exact=True)
    return report.lines()


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows) * 1e3


def _median_of_all(rows: list[dict[str, Any]], key: str) -> float | None:
    """`_median`, or None where some row lacks `key` (a run saved before it was timed)."""
    return _median(rows, key) if all(key in r for r in rows) else None


def _own_hit_step_ms(rows: list[dict[str, Any]], key: str = "vllm_hit") -> float | None:
    """The median of the step computing vLLM's own hit's last token (scheduled to first
    token), the hit right after the cold run or (`vllm_hit_settled`) once stores are done;
    None where the engine reported no phases."""
    steps = [r.get(f"{key}_phases", {}).get("running_ms") for r in rows]
    return statistics.median(steps) if steps and None not in steps else None


def _report(results: dict[str, dict[str, Any]], rate: float, per_token: int,
            lengths: list[int]) -> dict[str, Any]:
    """Print the tables; returns the summary that goes to --json."""
    summary: dict[str, Any] = {"h2d_gb_s": rate / 1e9, "kv_bytes_per_token": per_token,
                               "lengths": {}}
    print(f"\nhost-to-device rate (pinned, this run): {rate / 1e9:.1f} GB/s; KV: "
          f"{per_token // 1024} KiB per token")
    print(f"{'tokens':>7} {'cold':>8} {'vLLM hit':>9} {'floor':>8} {'kvdepot':>8} "
          f"{'x floor':>8} {'first':>8} {'vLLM hit w/ kvdepot':>20} {'offload':>8} "
          f"{'x floor':>8} {'lmcache':>8} {'x floor':>8} {'async':>8} {'x floor':>8}"
          "   (median ms; async: kvdepot with every load asynchronous)")
    base = results.get("none", {}).get("ttft", {})
    for length in lengths:
        line: dict[str, Any] = {}
        if length in base:
            line["cold"] = _median(base[length], "cold")
            line["vllm_hit"] = _median(base[length], "vllm_hit")
            line["floor"] = line["vllm_hit"] + _bytes_ms(length, per_token, rate)
        kv = results.get("kvdepot", {}).get("ttft", {}).get(length)
        if kv:
            line["kvdepot_hit"] = _median(kv, "hit")
            later = kv[1:] or kv
            line["kvdepot_first_hit"] = kv[0]["hit"] * 1e3
            line["kvdepot_later_hits"] = _median(later, "hit")
            for part, key in (("load", "waiting_ms"), ("step", "running_ms"),
                              ("retrieve", "server_retrieve_ms")):
                # The first hit split as vLLM times it, first against later: the wait for
                # the lookup and the load (kvdepot's part), and the step computing the rest;
                # beside them the server's own time on the retrieve, which a staged load
                # (`kvdepot.staging_mib`) spends inside the step's scheduling, not before.
                ms = [r.get("hit_phases", {}).get(key) for r in kv]
                if all(m is not None for m in ms):
                    line[f"kvdepot_first_{part}_ms"] = ms[0]
                    line[f"kvdepot_later_{part}s_ms"] = statistics.median(ms[1:] or ms)
            # vLLM's own hit of the same prompt before each hit: the engine's pace at
            # the time. An eager engine's step is bound by its host's CPU, whose speed
            # shifts for seconds at a time on a shared host (docs/benchmarks.md).
            line["vllm_hit_before_first_with_kvdepot"] = kv[0]["vllm_hit"] * 1e3
            line["vllm_hit_before_later_with_kvdepot"] = _median(later, "vllm_hit")
            line["vllm_hit_with_kvdepot"] = _median(kv, "vllm_hit")
            line["running_ms_with_kvdepot"] = _own_hit_step_ms(kv)
            line["vllm_hit_settled_with_kvdepot"] = _median_of_all(kv, "vllm_hit_settled")
            line["running_ms_settled_with_kvdepot"] = _own_hit_step_ms(kv, "vllm_hit_settled")
            line["kvdepot_loaded"] = [r["loaded"] for r in kv]
            line["kvdepot_phases"] = [r.get("hit_phases") for r in kv]
            line["kvdepot_same_token"] = all(r["hit_same"] for r in kv)
        noop = results.get("noop", {}).get("ttft", {}).get(length)
        if noop:
            line["vllm_hit_with_noop"] = _median(noop, "vllm_hit")
            line["running_ms_with_noop"] = _own_hit_step_ms(noop)
            line["vllm_hit_settled_with_noop"] = _median_of_all(noop, "vllm_hit_settled")
        if length in base:
            line["running_ms"] = _own_hit_step_ms(base[length])
            line["vllm_hit_settled"] = _median_of_all(base[length], "vllm_hit_settled")
            line["running_ms_settled"] = _own_hit_step_ms(base[length], "vllm_hit_settled")
        for name in ("offload", "lmcache", "kvdepot-async"):
            rows = results.get(name, {}).get("ttft", {}).get(length)
            if rows:
                line[f"{name}_hit"] = _median(rows, "hit")
                line[f"{name}_same_token"] = all(r["hit_same"] for r in rows)
                line[f"{name}_loaded"] = [r.get("hit_cached_tokens") for r in rows]
        summary["lengths"][length] = line
        floor = line.get("floor")

        def cell(key: str, line: dict[str, Any] = line) -> str:
            value = line.get(key)
            return f"{value:8.1f}" if value is not None else f"{'-':>8}"

        def ratio(key: str, line: dict[str, Any] = line, floor: float | None = floor) -> str:
            value = line.get(key)
            return f"{value / floor:7.2f}x" if value is not None and floor else f"{'-':>8}"

        print(f"{length:>7} {cell('cold')} {cell('vllm_hit'):>9} {cell('floor')} "
              f"{cell('kvdepot_hit')} {ratio('kvdepot_hit')} {cell('kvdepot_first_hit')} "
              f"{cell('vllm_hit_with_kvdepot'):>20} {cell('offload_hit')} "
              f"{ratio('offload_hit')} {cell('lmcache_hit')} {ratio('lmcache_hit')} "
              f"{cell('kvdepot-async_hit')} {ratio('kvdepot-async_hit')}")
    _floor_from_own_hits(base, summary, rate, per_token, lengths, "floor_every_own_hit",
                         "every own hit of the no-connector engine (after each cold run "
                         "and again later)")
    _floor_from_own_hits(results.get("kvdepot", {}).get("ttft", {}), summary, rate,
                         per_token, lengths, "floor_kvdepot_engine",
                         "the kvdepot engine's own hits of the same prompts")
    for name, result in results.items():
        rates = result.get("throughput") or []
        if rates:
            summary.setdefault("throughput", {})[name] = rates
    tput = summary.get("throughput", {})
    if "none" in tput and "kvdepot" in tput:
        ratio_ = statistics.median(tput["kvdepot"]) / statistics.median(tput["none"])
        summary["throughput_ratio"] = ratio_
        print(f"throughput with no reuse, kvdepot / no connector: {ratio_:.3f} (goal >= 0.98; "
              f"tokens/s {statistics.median(tput['kvdepot']):.0f} / "
              f"{statistics.median(tput['none']):.0f})")
        others = [name for name in ("noop", "offload", "lmcache") if name in tput]
        if others:
            print("  the others' / no connector: " + ", ".join(
                f"{'a connector doing nothing' if name == 'noop' else name} "
                f"{statistics.median(tput[name]) / statistics.median(tput['none']):.3f}"
                for name in others) + "; every batch's tokens/s: " + "; ".join(
                f"{name} " + ", ".join(f"{r:.0f}" for r in rates)
                for name, rates in tput.items()))
    for length in lengths:
        line = summary["lengths"][length]
        steps = {name: line.get(key) for name, key in (
            ("no connector", "running_ms"), ("a connector doing nothing", "running_ms_with_noop"),
            ("kvdepot", "running_ms_with_kvdepot"))}
        if steps["a connector doing nothing"] is not None:
            # The step computing vLLM's own hit's last token, queue to first token left out.
            print(f"vLLM's own hit at {length} tokens, its step (median ms): " + ", ".join(
                f"{name} {ms:.1f}" for name, ms in steps.items() if ms is not None))
        settled = (line.get("vllm_hit_settled"), line.get("vllm_hit_settled_with_kvdepot"))
        if None not in settled:
            noop_settled = line.get("vllm_hit_settled_with_noop")
            print(f"vLLM's own hit at {length} tokens once stores are done (median ms): no "
                  f"connector {settled[0]:.1f}, kvdepot {settled[1]:.1f}"
                  + ("" if noop_settled is None else
                     f", a connector doing nothing {noop_settled:.1f}")
                  + f"; its step {line.get('running_ms_settled') or 0:.1f} and "
                  f"{line.get('running_ms_settled_with_kvdepot') or 0:.1f}")
        if "kvdepot_first_hit" in line:
            print(f"first kvdepot hit at {length} tokens: {line['kvdepot_first_hit']:.1f} ms, "
                  f"later ones {line['kvdepot_later_hits']:.1f} "
                  f"({line['kvdepot_first_hit'] / line['kvdepot_later_hits']:.2f}x); its wait "
                  f"for the lookup and load {line.get('kvdepot_first_load_ms', 0):.1f} ms, "
                  f"later ones {line.get('kvdepot_later_loads_ms', 0):.1f}; its step "
                  f"{line.get('kvdepot_first_step_ms', 0):.1f}, later ones "
                  f"{line.get('kvdepot_later_steps_ms', 0):.1f}"
                  + ("" if "kvdepot_first_retrieve_ms" not in line else
                     f"; the server's retrieve {line['kvdepot_first_retrieve_ms']:.1f}, "
                     f"later ones {line['kvdepot_later_retrieves_ms']:.1f}")
                  + "; vLLM's own hit of the same "
                  f"prompt before it {line['vllm_hit_before_first_with_kvdepot']:.1f}, "
                  f"later ones {line['vllm_hit_before_later_with_kvdepot']:.1f} (the "
                  "engine's pace)")
            break
    for name in ("offload", "lmcache"):
        loaded = [n for length in lengths
                  for n in summary["lengths"][length].get(f"{name}_loaded", [])]
        if loaded:
            print(f"{name} hits: prompt tokens not computed (loaded), in order: "
                  + ", ".join("?" if n is None else str(n) for n in loaded))
    same = {name: [r["hit_same"] for rows in res.get("ttft", {}).values() for r in rows
                   if "hit_same" in r]
            for name, res in results.items() if "error" not in res}
    same = {name: values for name, values in same.items() if values}  # engines with hits
    base_same = [r["vllm_hit_same"] for res in results.values()
                 for rows in res.get("ttft", {}).values() for r in rows]
    print("first token the cold run's (bfloat16 rounding may flip a near tie): vLLM's own "
          f"hits {sum(base_same)} of {len(base_same)}" + "".join(
              f", {name} hits {sum(bool(v) for v in vals)} of {len(vals)}"
              for name, vals in same.items()))
    for name, res in results.items():
        if "connector_class" in res:
            summary.setdefault("connector_class", {})[name] = res["connector_class"]
        if res.get("cuda_ops") is False:
            summary.setdefault("without_cuda_ops", []).append(name)
            print(f"{name}: measured without its CUDA extension, copying with torch "
                  "operations (its server's log says so)")
        if "error" in res:
            summary.setdefault("failed", {})[name] = res["error"]
            reason = [line for line in str(res["error"]).strip().splitlines() if line.strip()]
            print(f"{name}: not measured, it failed (the whole reason and the tails of its "
                  "logs are in the JSON's raw results):\n    " + "\n    ".join(reason[-3:]))
    lines = results.get("kvdepot", {}).get("correctness")
    if lines:
        summary["correctness"] = lines
        print("\n".join(lines))
    return summary


def run(args: argparse.Namespace) -> int:
    import torch

    from kvdepot.testbed.checkpoint import LLAMA_8B_CONFIG

    gpu = cuda_device_name()
    if gpu is None:
        return 2
    lengths = [int(n) for n in args.prompt_lengths.split(",")]
    try:
        engines = parse_engines(args.engines)
    except ValueError as exc:
        print(exc)
        return 2
    config = {**LLAMA_8B_CONFIG, "num_hidden_layers": args.layers}
    per_token = kv_bytes_per_token(config)
    print(f"kvdepot bench e2e --device cuda: vLLM {_vllm_version()} on {gpu}; a "
          f"Llama-3.1-8B-shaped model with {args.layers} layers, seeded weights, bfloat16, "
          f"{execution_mode(args)}; prompts {lengths}, {args.prompts} each; chunk size "
          f"{CHUNK_SIZE}, block size {BLOCK_SIZE}; {machine()}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    started = time.perf_counter()
    model_dir = _model_dir(args.layers)
    print(f"  model written in {time.perf_counter() - started:.0f} s: {model_dir}", flush=True)
    rate = host_to_device_rate(max(lengths) * per_token)
    torch.cuda.empty_cache()  # the engines size their memory from what is free
    log = Path(tempfile.gettempdir()) / f"kvdepot-bench-e2e-gpu-{os.getpid()}.log"
    print(f"  vLLM's own log: {log}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    with server_process(CHUNK_SIZE, args.l1_size) as (url, _):
        for engine in engines:
            if engine == "lmcache":
                results[engine] = _run_lmcache(model_dir, args, log)
            else:
                results[engine] = in_spawned_process(
                    _engine_run, model_dir, engine, url if engine in KVDEPOT_ENGINES else None,
                    args, log)
            if args.json:  # what is done so far, should a later engine never end
                args.json.write_text(json.dumps(
                    {"partial": True, "engines_done": list(results), "raw": results},
                    indent=1, default=str))
    summary = _report(results, rate, per_token, lengths)
    summary.update(gpu=gpu, layers=args.layers, vllm=_vllm_version(),
                   cuda_graphs=args.cuda_graphs, raw=results)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1, default=str))
    lines = summary.get("correctness") or []
    return 1 if lines and not lines[-1].startswith("verdict: PASS") else 0


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError:
        return "not installed"
