"""`kvdepot bench flood`: one credential floods 32 MiB STOREs; does anyone else notice?

Issue 27: a client pipelining 32 MiB stores over a few connections delayed every other
client's PINGs by seconds and grew the server by about a gigabyte. This runs a real
server and, per scenario, a fresh one (so its peak RSS is that scenario's):

- baseline: a bystander PINGs an idle server;
- junk: 2-4 connections pipeline STOREs of ~32 MiB of junk block ids (under the largest
  message the protocol allows, so only the server's own bounds stop them);
- engine: 2-4 registered CPU engines pipeline legitimate STOREs of 32 MiB of KV each
  (fresh tokens every time, so every store copies and the tier keeps evicting);
- oversized: 2-4 connections send messages past the protocol's largest request.

The bystander is this process: one PING at a time on its own connection, its latency
p50/p99/max. Beside them, the server's peak RSS (VmHWM) and its CPU tier size.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from kvdepot.protocol import MAX_MESSAGE_BYTES, MAX_TOKENS, REQUEST_HEADER, RequestType
from kvdepot.sizes import parse_size
from kvdepot.testbed.measurement import machine, percentiles, server_process

MIB = 1 << 20
BLOCK = 16
SCENARIOS = ("baseline", "junk", "engine", "oversized")


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flood", help="bystander PING latency and server memory while one "
                                     "credential floods 32 MiB stores")
    p.add_argument("--connections", type=int, default=3,
                   help="flooding connections (default 3; the issue used 2-4)")
    p.add_argument("--seconds", type=float, default=6.0, help="flood length per scenario")
    p.add_argument("--store-mib", type=int, default=32, help="bytes per store (default 32)")
    p.add_argument("--window", type=int, default=64,
                   help="stores each flooding connection keeps in flight (default 64)")
    p.add_argument("--l1-size", default="1GiB", help="the server's CPU tier (default 1GiB)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.set_defaults(run=run)


# ---- flooders (each a spawned process holding one connection) -----------------------------
def _raw_dealer(url: str) -> Any:
    import zmq

    from kvdepot.rpc.credentials import find_credential

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    credential = find_credential(url)
    if credential is not None:
        credential.apply(sock, url)
    sock.connect(url)
    return sock


def _junk_store(nbytes: int) -> bytes:
    """A STORE whose token and block id lists fill `nbytes`, for an engine never registered:
    every byte is decoded before the server can tell it is worthless."""
    from kvdepot.protocol import ENCODER, Store

    ids = (nbytes - 4096) // 2 // 4 * 4
    filler = np.arange(ids // 4, dtype="<i4").tobytes()
    return ENCODER.encode(Store(instance_id=b"\1" * 16, request_id="flood", token_ids=filler,
                                start=0, end=0, block_ids=filler))


def _flood_raw(url: str, nbytes: int, window: int, seconds: float, start: Any,
               out: Any) -> None:
    """Pipeline `window` messages of `nbytes`, send one more per reply. Counts replies and
    what ended the connection, if anything did."""
    import zmq

    sock = _raw_dealer(url)
    body = _junk_store(min(nbytes, MAX_MESSAGE_BYTES - 64)) if nbytes <= MAX_MESSAGE_BYTES \
        else b"\0" * nbytes
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    start.wait()
    sent = replies = errors = disconnects = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        while sent - replies - errors < window:
            try:
                sock.send_multipart([REQUEST_HEADER.pack(sent, RequestType.STORE), body],
                                    flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            sent += 1
        if sock.poll(20):
            header, _ = sock.recv_multipart()
            if header[4]:
                errors += 1
            else:
                replies += 1
        while monitor.poll(0):
            monitor.recv_multipart()
            disconnects += 1
            # The server dropped the connection: what was in flight will never be answered.
            sent = replies + errors
    out.put({"sent": sent, "replies": replies, "errors": errors, "disconnects": disconnects})
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)


def engine_geometry(store_bytes: int, chunk_size: int) -> tuple[int, int, int]:
    """(layers, tokens per store, blocks in the engine) of a vLLM CPU cache with 8 KV heads
    of 128 dims in bf16 (4 KiB per token and layer) where one store is `store_bytes`."""
    per_token_layer = 8 * 128 * 2 * 2
    layers = 8
    tokens = max(chunk_size, store_bytes // (per_token_layer * layers) // chunk_size * chunk_size)
    return layers, tokens, 2 * tokens // BLOCK


def _flood_engine(url: str, store_bytes: int, chunk_size: int, window: int, seconds: float,
                  start: Any, out: Any) -> None:
    """A registered CPU engine pipelining `window` stores of fresh tokens."""
    import torch
    import zmq

    from kvdepot.integrations.vllm.mp_adapter import LMCacheMPWorkerAdapter, LoadStoreOp

    layers, tokens, blocks = engine_geometry(store_bytes, chunk_size)
    worker = LMCacheMPWorkerAdapter(url, zmq.Context.instance(), "flood-model",
                                    vllm_block_size=BLOCK, mq_timeout=60)
    raw = torch.ones(layers * blocks * 8 * BLOCK * 256, dtype=torch.bfloat16)
    worker.register_kv_caches({
        f"layers.{i}.attn": raw.view(layers, blocks, 8, BLOCK, 256)[i] for i in range(layers)})
    rng = np.random.default_rng(os.getpid())
    start.wait()
    pending: list[Any] = []
    done = errors = n = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        while len(pending) < window:
            op = LoadStoreOp(rng.integers(0, 1 << 30, tokens).tolist(),
                             list(range(tokens // BLOCK)), 0, tokens)
            worker.submit_store_request(f"s{n}", op, None)
            pending.append(worker.store_ops.pop(f"s{n}")[0].future)
            n += 1
        try:
            pending[0].result(60)
            done += 1
        except Exception:  # counted: an error reply is an answer too
            errors += 1
        pending.pop(0)
    out.put({"sent": n, "replies": done, "errors": errors, "disconnects": 0})
    worker.shutdown()


# ---- the bystander and the server's memory --------------------------------------------
def _bystander(url: str, seconds: float, interval: float = 0.01) -> tuple[list[float], int]:
    """PING latencies over `seconds`, and how many PINGs got no answer in 10 s."""
    from kvdepot.rpc.connection import DepotConnection

    conn = DepotConnection(url, connect_timeout=30)
    samples: list[float] = []
    lost = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                conn.call(RequestType.PING, timeout=10)
                samples.append(time.perf_counter() - t0)
            except TimeoutError:
                lost += 1
            time.sleep(interval)
    finally:
        conn.close()
    return samples, lost


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def _scenario(args: argparse.Namespace, name: str) -> dict[str, Any]:
    store_bytes = args.store_mib * MIB
    with server_process(args.chunk_size, args.l1_size) as (url, proc):
        idle_rss = peak_rss_mib(proc.pid)
        ctx = mp.get_context("spawn")
        start, out = ctx.Event(), ctx.Queue()
        procs = []
        if name != "baseline":
            for _ in range(args.connections):
                if name == "engine":
                    target, extra = _flood_engine, (url, store_bytes, args.chunk_size)
                else:
                    size = store_bytes if name == "junk" else MAX_MESSAGE_BYTES + MIB
                    target, extra = _flood_raw, (url, size)
                procs.append(ctx.Process(target=target, daemon=True,
                                         args=(*extra, args.window, args.seconds + 1.0,
                                               start, out)))
            for p in procs:
                p.start()
            time.sleep(3.0)  # spawned interpreters import and register before the clock
        start.set()
        time.sleep(0.5)  # the flood is under way before the first PING
        samples, lost = _bystander(url, args.seconds)
        floods = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        alive = proc.poll() is None
        peak = peak_rss_mib(proc.pid) if alive else float("nan")
    return {"ping": percentiles(samples) if samples else None, "lost": lost,
            "pings": len(samples), "peak_rss": peak, "idle_rss": idle_rss, "alive": alive,
            "floods": floods}


def run(args: argparse.Namespace) -> int:
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    l1 = parse_size(args.l1_size)
    layers, tokens, _ = engine_geometry(args.store_mib * MIB, args.chunk_size)
    print(f"kvdepot bench flood: {args.connections} flooding connections of one credential, "
          f"{args.window} stores in flight each, {args.seconds:.0f} s per scenario; "
          f"{machine()}; load average {os.getloadavg()[0]:.2f}")
    print(f"stores: junk {args.store_mib} MiB messages (largest request the protocol allows: "
          f"{MAX_MESSAGE_BYTES / MIB:.0f} MiB, {MAX_TOKENS} ids per list); engine {tokens} "
          f"tokens x {layers} layers = {args.store_mib} MiB of KV; oversized "
          f"{(MAX_MESSAGE_BYTES + MIB) / MIB:.0f} MiB")
    print(f"server CPU tier: {l1 / MIB:.0f} MiB")
    header = (f"{'scenario':11}{'pings':>7}{'lost':>6}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
              f"{'idle RSS':>10}{'peak RSS':>10}  flood (replies/errors/disconnects)")
    print(header)
    for name in scenarios:
        r = _scenario(args, name)
        lat = r["ping"] or {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
        flood = ", ".join(f"{f['replies']}/{f['errors']}/{f['disconnects']}"
                          for f in r["floods"]) or "-"
        print(f"{name:11}{r['pings']:7d}{r['lost']:6d}{lat['p50']:9.2f}{lat['p99']:9.2f}"
              f"{lat['max']:9.1f}{r['idle_rss']:9.0f}M{r['peak_rss']:9.0f}M  {flood}"
              + ("" if r["alive"] else "  SERVER EXITED"), flush=True)
    print("goal: bystander PING p99 <= 50 ms under every flood; peak RSS bounded by the tier "
          "plus a per-connection in-flight bound (see docs/security.md)")
    return 0

