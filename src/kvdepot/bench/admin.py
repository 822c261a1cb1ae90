"""`kvdepot bench admin`: what serving the admin API costs the data and control planes.

One server with `--admin-port`; lookup latency (as `bench control` measures it) and
store+retrieve bandwidth (as `bench transfer` does, one CPU geometry) are measured in
alternating phases without and with a client process polling `GET /v1/status` every
100 ms (in the order without, with, with, without, ... so that running second in a pair
favours neither), so both sides see the same machine state; the figures compare the
medians over the phases of each kind.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from kvdepot.bench.control import BLOCK, _fill_cache
from kvdepot.bench.transfer.load import CHUNK, Load, run_phase
from kvdepot.client.kv_export import describe_kv_caches
from kvdepot.integrations.vllm.mp_adapter import LMCacheMPSchedulerAdapter, LMCacheMPWorkerAdapter
from kvdepot.testbed.kv_geometry import CPU_GEOMETRIES
from kvdepot.testbed.measurement import machine, percentiles
from kvdepot.testbed.server_process import ServerProcess, free_port
from kvdepot.transfer.layout import KVLayout


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("admin", help="lookup p50 and transfer GB/s with and without a client "
                                     "polling the admin API")
    p.add_argument("--tokens", type=int, default=32768, help="lookup prompt length")
    p.add_argument("--lookups", type=int, default=500, help="lookups per phase")
    p.add_argument("--seconds", type=float, default=1.0, help="per transfer phase")
    p.add_argument("--rounds", type=int, default=8,
                   help="phase pairs (without, with polling) of each kind")
    p.add_argument("--poll-ms", type=float, default=100.0, help="polling period")
    p.add_argument("--l1-size", default="2GiB")
    p.add_argument("--poll-elsewhere", action="store_true",
                   help="the control experiment: the same client polls a bare HTTP server "
                        "(python -m http.server) instead, so only its own CPU use remains")
    p.add_argument("--json", help="write the figures to this file")
    p.set_defaults(run=run)


def _poller(admin_url: str, period: float, polling: Any, stop: Any, count: Any) -> None:
    """GET /v1/status every `period` seconds while `polling` is set."""
    while not stop.is_set():
        if not polling.wait(0.05):
            continue
        started = time.monotonic()
        with urllib.request.urlopen(admin_url + "/v1/status", timeout=10) as r:
            json.loads(r.read())
        with count.get_lock():
            count.value += 1
        time.sleep(max(0.0, period - (time.monotonic() - started)))


def _order(round_number: int) -> tuple[str, str]:
    """Without and with polling, then with and without (ABBA): a phase that runs second in
    its pair (a fuller tier, a warmer cache) favours neither kind."""
    return ("off", "on") if round_number % 2 == 0 else ("on", "off")


def _lookups(scheduler: LMCacheMPSchedulerAdapter, tokens: list[int], n: int, tag: str
             ) -> list[float]:
    samples = []
    for i in range(n):
        request_id = f"{tag}-{i}"
        t0 = time.perf_counter()
        scheduler.maybe_submit_lookup_request(request_id, tokens)
        while scheduler.check_lookup_result(request_id) is None:
            pass
        samples.append(time.perf_counter() - t0)
        scheduler.cleanup_lookup_result(request_id)
        scheduler.end_session(request_id)
    return samples


def _bare_http_server() -> tuple[str, subprocess.Popen[bytes]]:
    """A directory holding one `v1/status` file (a status document), served by the
    standard library's HTTP server in its own process."""
    root = Path(tempfile.mkdtemp(prefix="kvdepot-bench-admin-"))
    (root / "v1").mkdir()
    (root / "v1" / "status").write_text(json.dumps({"counters": {}, "tiers": []}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                             "127.0.0.1", "--directory", str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/status", timeout=1):
                return url, proc
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _status_cpu_ms(server: ServerProcess, admin_url: str, n: int = 300) -> float:
    """Server CPU time (all threads) per GET /v1/status, requests back to back."""
    before = server.cpu_seconds()
    for _ in range(n):
        with urllib.request.urlopen(admin_url + "/v1/status", timeout=10) as r:
            r.read()
    return (server.cpu_seconds() - before) / n * 1e3


def run(args: argparse.Namespace) -> int:
    target = ("a bare HTTP server (the control experiment)" if args.poll_elsewhere
              else "the admin API")
    print(f"kvdepot bench admin: {machine()}; a client polls GET /v1/status of {target} "
          f"every {args.poll_ms:g} ms in every other phase")
    admin_port = free_port()
    admin_url = f"http://127.0.0.1:{admin_port}"
    server = ServerProcess(chunk_size=CHUNK, l1_size=args.l1_size, output="inherit",
                           extra=("--log-level", "WARNING", "--admin-port", str(admin_port)))
    ctx = mp.get_context("spawn")
    polling, stop, count = ctx.Event(), ctx.Event(), ctx.Value("i", 0)
    poller = ctx.Process(target=_poller, args=(admin_url, args.poll_ms / 1000, polling, stop,
                                               count), daemon=True)
    figures: dict[str, Any] = {"lookup_p50_ms": {"off": [], "on": []},
                               "store_retrieve_gbps": {"off": [], "on": []}, "polls": 0}
    elsewhere = None
    if args.poll_elsewhere:
        elsewhere = _bare_http_server()
        admin_url = elsewhere[0]
        poller = ctx.Process(target=_poller, args=(admin_url, args.poll_ms / 1000, polling, stop,
                                                   count), daemon=True)
    with server:
        poller.start()
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 128_000, args.tokens + 1).tolist()
        _fill_cache(server.url, tokens[:args.tokens], CHUNK)
        scheduler = LMCacheMPSchedulerAdapter(server.url, zmq.Context.instance(),
                                              "bench-model", vllm_block_size=BLOCK)
        _lookups(scheduler, tokens, 100, "warm")
        figures["server_cpu_ms_per_status"] = _status_cpu_ms(
            server, f"http://127.0.0.1:{admin_port}")
        for r in range(args.rounds):
            for mode in _order(r):
                (polling.set if mode == "on" else polling.clear)()
                time.sleep(0.3)
                p50 = percentiles(_lookups(scheduler, tokens, args.lookups, f"{mode}{r}"))["p50"]
                figures["lookup_p50_ms"][mode].append(p50)
        polling.clear()
        scheduler.shutdown()

        geometry = CPU_GEOMETRIES[0]
        blocks_per_op = 8 * CHUNK // geometry.block_size
        num_blocks = 4 * blocks_per_op
        caches = geometry.build(num_blocks, "cpu")
        storages, specs = describe_kv_caches(caches, geometry.block_size)
        chunk_bytes = KVLayout(specs, [s.nbytes() for s in storages],
                               geometry.block_size).chunk_bytes(CHUNK)
        worker = LMCacheMPWorkerAdapter(server.url, None, "bench-admin",
                                        vllm_block_size=geometry.block_size)
        try:
            worker.register_kv_caches(caches)
            load = Load(worker, num_blocks, 8, geometry.block_size, False, chunk_bytes)
            run_phase("warm-up", server, load, 60.0, 4, True, False,
                      stop_after_bytes=server_bytes(args.l1_size))
            for r in range(args.rounds):
                for mode in _order(r):
                    load.fill_retrieve_set(4)  # again: the last phase's stores evict
                    (polling.set if mode == "on" else polling.clear)()
                    time.sleep(0.3)
                    phase = run_phase(f"{mode}{r}", server, load, args.seconds, 4, True, True)
                    figures["store_retrieve_gbps"][mode].append(
                        phase.store_gbps + phase.retrieve_gbps)
        finally:
            worker.shutdown()
        stop.set()
        poller.join(10)
        figures["polls"] = count.value
    if elsewhere is not None:
        elsewhere[1].terminate()
        elsewhere[1].wait(10)

    lat, bw = figures["lookup_p50_ms"], figures["store_retrieve_gbps"]
    lat_off, lat_on = statistics.median(lat["off"]), statistics.median(lat["on"])
    bw_off, bw_on = statistics.median(bw["off"]), statistics.median(bw["on"])
    print(f"{args.tokens}-token lookup p50, ms (median of {args.rounds} phases of "
          f"{args.lookups}): without polling {lat_off:.3f}, with {lat_on:.3f} "
          f"({100 * (lat_on / lat_off - 1):+.1f} %)")
    print(f"  phases without: {' '.join(f'{v:.3f}' for v in lat['off'])}; with: "
          f"{' '.join(f'{v:.3f}' for v in lat['on'])}")
    print(f"store+retrieve GB/s ({geometry.name}, median of {args.rounds} phases of "
          f"{args.seconds:g} s): without polling {bw_off:.2f}, with {bw_on:.2f} "
          f"({100 * (bw_on / bw_off - 1):+.1f} %)")
    print(f"  phases without: {' '.join(f'{v:.2f}' for v in bw['off'])}; with: "
          f"{' '.join(f'{v:.2f}' for v in bw['on'])}")
    print(f"status requests served meanwhile: {figures['polls']}")
    cost = figures["server_cpu_ms_per_status"]
    print(f"server CPU per GET /v1/status: {cost:.3f} ms (all threads, {300} back to back); "
          f"at one every {args.poll_ms:g} ms that is {cost / args.poll_ms * 100:.2f} % of one "
          "core")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


def server_bytes(size: str) -> int:
    from kvdepot.sizes import parse_size

    return parse_size(size)
