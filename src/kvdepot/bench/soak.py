"""`kvdepot bench soak --minutes N`: engines that come and go, faults, and nothing that leaks.

Engine processes register, run the byte-checking workload (`verified_workload`: lookups,
loads, stores, with shared prompts so they hit each other's chunks) and then either crash
(SIGKILL) or shut down cleanly, and new ones take their place; meanwhile the server is
stopped (SIGSTOP) for longer than the engines' heartbeat and continued, at seeded
moments. The run asserts, and prints, zero wrong bytes, a server whose RSS and open file
descriptors are as flat as they were after the warm-up, and no lookup lock left once
every engine has ended and the lock TTL has passed. Exits 1 when an assertion fails.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import random
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvdepot.testbed.measurement import machine, server_process

T = TypeVar("T")

CHUNK = 64
BLOCK = 16
NUM_BLOCKS = 128
LAYERS, HEADS, HEAD_DIM = 2, 2, 32
MODEL = "soak-model"
LOCK_TTL = 5.0
REPORT_INTERVAL = 0.5
SETTLE_S = 5.0
"""How long the server may take to close the connections that just went (the statistics
client's own among them) before its fds are counted."""
RSS_SLACK = 16 << 20
"""Growth of the server's RSS between warm-up and end that still counts as flat (allocator
and interpreter noise; a leak per operation or per registration grows without bound)."""


def _engine_main(url: str, seed: int, prompt_seed: int, conn: Any) -> None:
    """One engine process: register, run the workload until told to stop (or killed)."""
    logging.basicConfig(level=logging.CRITICAL)  # every failed load logs; counts tell
    try:
        import torch
        import zmq

        from kvdepot.integrations.vllm.mp_adapter import (
            LMCacheMPSchedulerAdapter,
            LMCacheMPWorkerAdapter,
        )
        from kvdepot.testbed.verified_workload import VerifiedWorkload

        ctx = zmq.Context()
        common = dict(vllm_block_size=BLOCK, heartbeat_interval=1.0, mq_timeout=2.0)
        deadline = time.monotonic() + 60

        def retried(make: Callable[[], T]) -> T:
            """The server may be stopped (or restarting) right now: try until the deadline."""
            while True:
                try:
                    return make()
                except (ConnectionError, TimeoutError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

        worker = retried(lambda: LMCacheMPWorkerAdapter(url, ctx, MODEL, **common))
        scheduler = retried(lambda: LMCacheMPSchedulerAdapter(url, ctx, MODEL, **common))
        # vLLM's CPU layout: [blocks, heads, block size, K and V dims].
        caches = {f"layers.{i}.attn": torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM,
                                                  dtype=torch.bfloat16) for i in range(LAYERS)}
        retried(lambda: worker.register_kv_caches(caches))
        workload = VerifiedWorkload(worker, scheduler, caches, NUM_BLOCKS, BLOCK,
                                    scheduler.chunk_size, seed, name=f"e{seed}",
                                    prompt_seed=prompt_seed)
        conn.send(("counts", workload.counts.as_dict()))
        last = time.monotonic()
        while not conn.poll():
            wrong = workload.counts.wrong_blocks
            workload.step()
            if time.monotonic() - last > REPORT_INTERVAL or workload.counts.wrong_blocks != wrong:
                conn.send(("counts", workload.counts.as_dict()))
                last = time.monotonic()
        conn.recv()
        conn.send(("final", workload.finish().as_dict()))
        worker.shutdown()
        scheduler.shutdown()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


@dataclass
class _Engine:
    proc: Any
    conn: Any
    ends_at: float
    crash: bool
    counts: dict[str, Any] = field(default_factory=dict)
    stopping: bool = False
    finished: bool = False

    def drain(self, errors: list[str]) -> None:
        try:
            while self.conn.poll():
                kind, value = self.conn.recv()
                if kind == "error":
                    errors.append(value)
                    self.finished = True
                else:
                    self.counts = value
                    self.finished |= kind == "final"
        except (EOFError, OSError):
            self.finished = True


class Soak:
    def __init__(self, url: str, server: Any, engines: int, seed: int) -> None:
        self.url = url
        self.server = server
        self.engines_at_once = engines
        self.rng = random.Random(seed)
        self.prompt_seed = seed
        self.ctx = mp.get_context("spawn")
        self.live: list[_Engine] = []
        self.ended: list[_Engine] = []
        self.errors: list[str] = []
        self.started = self.crashed = self.exited = self.stalls = 0
        self.stalled_s = 0.0
        self.next_stall = time.monotonic() + self.rng.uniform(2.0, 6.0)

    # ---- engines ------------------------------------------------------------------------
    def _start_engine(self) -> None:
        parent, child = self.ctx.Pipe()
        self.started += 1
        proc = self.ctx.Process(target=_engine_main, daemon=True, args=(
            self.url, self.rng.randrange(1 << 30), self.prompt_seed, child))
        proc.start()
        child.close()
        self.live.append(_Engine(proc, parent, time.monotonic() + self.rng.uniform(5, 15),
                                 crash=self.rng.random() < 0.7))

    def _end(self, engine: _Engine, crash: bool) -> None:
        if crash:
            engine.proc.kill()
            engine.proc.join()
            engine.drain(self.errors)
            self.crashed += 1
            self._retire(engine)
        elif not engine.stopping:
            engine.stopping = True
            with contextlib.suppress(OSError):
                engine.conn.send("stop")

    def _retire(self, engine: _Engine) -> None:
        self.live.remove(engine)
        self.ended.append(engine)
        engine.conn.close()

    def _tend(self, replace: bool) -> None:
        now = time.monotonic()
        for engine in list(self.live):
            engine.drain(self.errors)
            if engine.stopping and (engine.finished or not engine.proc.is_alive()):
                engine.proc.join(timeout=30)
                self.exited += 1
                self._retire(engine)
            elif engine.finished and not engine.stopping:  # it failed
                engine.proc.join(timeout=30)
                self._retire(engine)
            elif now >= engine.ends_at and not engine.stopping:
                self._end(engine, engine.crash)
        while replace and len(self.live) < self.engines_at_once:
            self._start_engine()

    def end_all(self) -> None:
        for engine in list(self.live):
            self._end(engine, crash=engine.crash)
        deadline = time.monotonic() + 120
        while self.live and time.monotonic() < deadline:
            self._tend(replace=False)
            time.sleep(0.05)
        for engine in list(self.live):
            self.errors.append("an engine did not stop within 120 s")
            self._end(engine, crash=True)

    # ---- faults -------------------------------------------------------------------------
    def _maybe_stall(self) -> None:
        if time.monotonic() < self.next_stall:
            return
        stall = self.rng.uniform(1.2, 3.0)  # past the engines' 1 s heartbeat
        os.kill(self.server.pid, signal.SIGSTOP)
        self.stalls += 1
        try:
            end = time.monotonic() + stall
            while time.monotonic() < end:
                self._tend(replace=False)  # engines keep running and reporting meanwhile
                time.sleep(0.05)
        finally:
            os.kill(self.server.pid, signal.SIGCONT)
        self.stalled_s += stall
        self.next_stall = time.monotonic() + self.rng.uniform(3.0, 10.0)

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.errors:
            self._tend(replace=True)
            self._maybe_stall()
            time.sleep(0.05)

    def totals(self) -> dict[str, int]:
        keys = ("lookups", "hits", "stores", "retrieves", "load_errors", "verified_blocks",
                "verified_bytes", "wrong_loaded_blocks", "overwritten_recomputed_blocks",
                "wrong_blocks", "wrong_bytes")
        return {k: sum(int(e.counts.get(k, 0)) for e in self.ended + self.live) for k in keys}


def _server_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _server_fds(pid: int) -> dict[str, str]:
    """The server's open file descriptors and what each one is."""
    fds = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            fds[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return fds


def _settled_fds(pid: int, at_most: int) -> dict[str, str]:
    """The server's fds once no more than `at_most` are open, or after SETTLE_S: a
    connection that just went may take the server a moment to close."""
    deadline = time.monotonic() + SETTLE_S
    while len(fds := _server_fds(pid)) > at_most and time.monotonic() < deadline:
        time.sleep(0.05)
    return fds


def _stats(url: str) -> dict[str, float]:
    from kvdepot.client.admin import AdminClient

    with AdminClient(url) as admin:
        return admin.stats()


def _quiesce(url: str, timeout: float) -> dict[str, float]:
    """Stats once no engine is registered and no lookup holds a lock (killed engines are
    reaped within a second, their lookups expire after the TTL); the last stats if that
    never happens."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(url)
        idle = (stats["registered_engines"] == 0 and stats["lookup_jobs"] == 0
                and stats["locked_chunks"] == 0)
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.25)


def run(args: argparse.Namespace) -> int:
    total_s = args.minutes * 60.0
    warmup_s = max(5.0, 0.2 * total_s)
    mib = 1 << 20
    print(f"kvdepot bench soak: {args.minutes:g} minutes, {args.engines} engines at a time, "
          f"seed {args.seed}; {machine()}", flush=True)
    with server_process(chunk_size=CHUNK, l1_size="256MiB",
                        extra=("--lock-ttl", str(LOCK_TTL))) as (url, server):
        soak = Soak(url, server, args.engines, args.seed)
        started = time.monotonic()
        try:
            soak.run_for(warmup_s)
            soak.end_all()
            _quiesce(url, LOCK_TTL * 4)
            time.sleep(SETTLE_S)
            rss_start, fds_start = _server_rss(server.pid), _server_fds(server.pid)
            soak.run_for(total_s - warmup_s)
            soak.end_all()
            final = _quiesce(url, LOCK_TTL * 4)
            fds_end = _settled_fds(server.pid, len(fds_start))
            rss_end = _server_rss(server.pid)
        finally:
            for engine in list(soak.live):
                engine.proc.kill()
        elapsed = time.monotonic() - started
    totals = soak.totals()
    wrong_bytes = totals["wrong_bytes"]
    leaked = int(final["locked_chunks"] + final["lookup_jobs"])
    checks = {
        "wrong bytes": wrong_bytes == 0,
        "loads were checked": totals["verified_blocks"] > 0,
        "server RSS flat": rss_end <= rss_start + max(RSS_SLACK, rss_start // 20),
        "server fds flat": len(fds_end) <= len(fds_start),
        "no leaked locks": leaked == 0,
        "every engine unregistered or reaped": final["registered_engines"] == 0,
        "no engine failed": not soak.errors,
    }
    ops = totals["lookups"] + totals["stores"] + totals["retrieves"]
    print(f"  ran {elapsed:.0f} s (warm-up {warmup_s:.0f} s); engine processes "
          f"{soak.started}: {soak.crashed} crashed (SIGKILL), {soak.exited} exited cleanly")
    print(f"  operations:    {ops} (lookups {totals['lookups']}, hits {totals['hits']}, "
          f"retrieves {totals['retrieves']}, stores {totals['stores']}); load errors "
          f"{totals['load_errors']}; server counted {int(final['stores'])} stores, "
          f"{int(final['retrieves'])} retrieves, {int(final['cancelled_operations'])} "
          "cancelled by their fence")
    print(f"  faults:        {soak.stalls + soak.crashed} ({soak.stalls} server stalls, "
          f"SIGSTOP {soak.stalled_s:.0f} s in all; {soak.crashed} engine crashes)")
    print(f"  wrong bytes:   {wrong_bytes} (checked {totals['verified_bytes'] / mib:.1f} MiB "
          f"in {totals['verified_blocks']} loaded blocks; wrong blocks: "
          f"{totals['wrong_loaded_blocks']} loaded, {totals['overwritten_recomputed_blocks']} "
          "recomputed then overwritten)")
    print(f"  server RSS:    start {rss_start / mib:.1f} MiB, end {rss_end / mib:.1f} MiB "
          "(after the warm-up and at the end, both with every engine gone)")
    new = sorted(set(fds_end.values()) - set(fds_start.values()))
    print(f"  server fds:    start {len(fds_start)}, end {len(fds_end)}"
          + (f" (new: {', '.join(new)})" if len(fds_end) > len(fds_start) else ""))
    print(f"  leaked locks:  {leaked} ({int(final['locked_chunks'])} locked chunks, "
          f"{int(final['lookup_jobs'])} lookup jobs once every engine ended and the "
          f"{LOCK_TTL:g} s lock TTL passed)")
    for error in soak.errors[:3]:
        print(f"  engine failure:\n{error}")
    failed = [name for name, ok in checks.items() if not ok]
    print(f"  result:        {'FAILED: ' + ', '.join(failed) if failed else 'ok'}", flush=True)
    return 1 if failed else 0


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("soak", help="engines that crash and come back, server stalls: zero "
                                    "wrong bytes, flat RSS and fds, no leaked locks")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--engines", type=int, default=2, help="engine processes at a time")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(run=run)
