"""`kvdepot bench control`: lookup latency and throughput of the control plane.

One lookup = LOOKUP (which locks the hit) + QUERY_PREFETCH_STATUS until it is not None,
through the seed-compatible scheduler adapter, for a prompt whose chunks are all in CPU
memory. The limit beside it is a bare ZeroMQ DEALER/ROUTER round trip carrying the same
bytes (the packed prompt) to an echo process on the same machine: what any server
reached over this transport must pay.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

import numpy as np
import torch
import zmq

from kvdepot.integrations.vllm.mp_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
)
from kvdepot.native import HASHES_IN_C, NATIVE_HASH_VARIABLE
from kvdepot.protocol import pack_ints
from kvdepot.testbed.measurement import machine, percentiles, server_process

BLOCK = 16


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("control", help="lookup latency (p50/p99) and lookups/s")
    p.add_argument("--tokens", type=int, default=32768, help="prompt length (default 32768)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--clients", type=int, default=8, help="concurrent clients for throughput")
    p.add_argument("--seconds", type=float, default=5.0, help="throughput run length")
    p.add_argument("--insecure", action="store_true",
                   help="run the server without authentication (to measure what it costs)")
    p.add_argument("--shared-tier", "--remote", dest="remote", default=None, metavar="URL",
                   help="start the server with this shared tier (e.g. an unreachable one, to "
                        "measure lookups with its breaker open)")
    p.add_argument("--block-hashes", action="store_true",
                   help="send vLLM block hashes with each timed lookup, as a connector does "
                        "when its engine publishes KV events (32 bytes per block)")
    p.add_argument("--tail-tokens", type=int, default=0,
                   help="tokens past the prompt's last whole chunk, stored as a tail; lookups "
                        "then ask for tails and hit it (default 0: whole chunks only)")
    p.add_argument("--cached-share", type=float, default=1.0,
                   help="the share of the prompt's chunks in CPU memory (default 1: all); "
                        "below 1 every lookup runs past CPU memory into the lower tiers")
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="idle milliseconds before each timed lookup and each round trip of "
                        "the limit (default 0: back to back). An engine's lookup comes after "
                        "its scheduler and the server sat idle, and on many hosts every "
                        "thread a message wakes then pays for leaving a CPU idle state")
    p.set_defaults(run=run)


def _fill_cache(url: str, tokens: list[int], chunk_size: int, tail: int = 0) -> None:
    """Store every chunk of the prompt, and a tail of `tail` tokens after them, from a tiny
    synthetic engine (bytes do not matter)."""
    nblocks = -(-len(tokens) // BLOCK)
    worker = LMCacheMPWorkerAdapter(url, zmq.Context.instance(), "bench-model",
                                    vllm_block_size=BLOCK)
    worker.register_kv_caches({"layer.0": torch.zeros(nblocks, BLOCK, 8, dtype=torch.bfloat16)})
    worker.submit_store_request("fill", LoadStoreOp(tokens, list(range(nblocks)), 0,
                                                    len(tokens), tail_tokens=tail), None)
    while not worker.get_finished({"fill"})[0]:
        time.sleep(0.01)
    worker.shutdown()


def _lookup_once(scheduler: LMCacheMPSchedulerAdapter, req: str, tokens: list[int],
                 tails: bool) -> int:
    scheduler.maybe_submit_lookup_request(req, tokens, tails=tails)
    while (hit := scheduler.check_lookup_result(req)) is None:
        pass
    scheduler.cleanup_lookup_result(req)
    scheduler.end_session(req)
    return hit


def _throughput_client(url: str, tokens: list[int], tails: bool, seconds: float, start: Any,
                       out: Any) -> None:
    scheduler = LMCacheMPSchedulerAdapter(url, zmq.Context(), "bench-model",
                                          vllm_block_size=BLOCK)
    start.wait()
    n, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        _lookup_once(scheduler, f"t{mp.current_process().pid}-{n}", tokens, tails)
        n += 1
    out.put(n)
    scheduler.shutdown()


def _echo_server(url: str, ready: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(url)
    ready.set()
    while True:
        frames = sock.recv_multipart()
        if frames[-1] == b"stop":
            break
        sock.send_multipart([frames[0], frames[1], b"\0" * 8])
    sock.close(linger=0)


def bare_round_trip(payload: bytes, iterations: int, gap_s: float = 0.0) -> list[float]:
    """DEALER -> ROUTER echo in another process, same bytes as a lookup request, each
    round trip after `gap_s` idle."""
    from kvdepot.testbed.server_process import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_echo_server, args=(url, ready), daemon=True)
    proc.start()
    ready.wait(60)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(url)
    samples = []
    warm_up = 100  # untimed round trips first, back to back
    for i in range(warm_up + iterations):
        timed = i >= warm_up
        if gap_s and timed:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        sock.send_multipart([i.to_bytes(6, "little"), payload])
        sock.recv_multipart()
        if timed:
            samples.append(time.perf_counter() - t0)
    sock.send_multipart([b"x", b"stop"])
    proc.join(10)
    sock.close(linger=0)
    return samples


def run(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(0)
    # +1: a prompt's last token
    tokens = rng.integers(0, 128_000, args.tokens + args.tail_tokens + 1).tolist()
    chunks = args.tokens // args.chunk_size
    tail = args.tail_tokens
    hashing = ("C (kvdepot.native)" if HASHES_IN_C
               else f"the blake3 package ({NATIVE_HASH_VARIABLE}=0 or no extension)")
    cached = int(chunks * args.cached_share)
    print(f"kvdepot bench control: {args.tokens}-token prompt ({chunks} chunks of "
          f"{args.chunk_size}), {'all' if cached == chunks else cached} in CPU memory; key "
          f"chains hashed in {hashing}; {machine()}")
    auth = ("--insecure",) if args.insecure else ()
    print(f"authentication: {'off (--insecure)' if args.insecure else 'on (CURVE)'}"
          + ("; timed lookups carry vLLM block hashes" if args.block_hashes else "")
          + (f"; lookups ask for tails, and hit one of {tail} tokens" if tail else "")
          + (f"; {args.gap_ms:g} ms idle before each timed lookup and round trip"
             if args.gap_ms else "; back to back"))
    extra = (*auth, *(("--shared-tier", args.remote) if args.remote else ()))
    if args.remote:
        print(f"shared tier: {args.remote}")
    with server_process(args.chunk_size, "1GiB", extra=extra) as (url, _):
        tail = tail if cached == chunks else 0  # a tail only after every chunk
        _fill_cache(url, tokens[:cached * args.chunk_size + tail], args.chunk_size, tail)
        scheduler = LMCacheMPSchedulerAdapter(url, zmq.Context.instance(), "bench-model",
                                              vllm_block_size=BLOCK)
        expected = cached * args.chunk_size + tail
        asks_tails = bool(args.tail_tokens)
        assert _lookup_once(scheduler, "warm", tokens, asks_tails) == expected
        samples = []
        # Stand-ins for vLLM's sha256 block hashes: only their size matters here.
        hashes = ([i.to_bytes(32, "little") for i in range(args.tokens // BLOCK)]
                  if args.block_hashes else [])
        for i in range(args.iterations):
            request_id = f"r{i}"
            if args.gap_ms:
                time.sleep(args.gap_ms / 1e3)
            t0 = time.perf_counter()
            scheduler.maybe_submit_lookup_request(request_id, tokens, block_hashes=hashes,
                                                  tails=asks_tails)
            while (hit := scheduler.check_lookup_result(request_id)) is None:
                pass
            samples.append(time.perf_counter() - t0)
            # Untimed: the request's end (a fire-and-forget notice) releases its locks.
            scheduler.cleanup_lookup_result(request_id)
            scheduler.end_session(request_id)
            if hit != expected:
                raise RuntimeError(f"lookup {i} hit {hit} tokens, expected {expected}")
        scheduler.shutdown()
        lat = percentiles(samples)

        ctx = mp.get_context("spawn")
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_throughput_client,
                             args=(url, tokens, asks_tails, args.seconds, start, out))
                 for _ in range(args.clients)]
        for p in procs:
            p.start()
        time.sleep(1.0)  # let every client connect before the clock starts
        start.set()
        total = sum(out.get(timeout=args.seconds + 120) for _ in procs)
        for p in procs:
            p.join(30)
        rate = total / args.seconds

    bare = percentiles(bare_round_trip(pack_ints(tokens), args.iterations, args.gap_ms / 1e3))
    print(f"{'':32}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    print(f"{'lookup + status (kvdepot)':32}" + "".join(f"{lat[k]:9.3f}" for k in lat))
    print(f"{'bare ZeroMQ round trip (limit)':32}" + "".join(f"{bare[k]:9.3f}" for k in bare))
    print(f"ratio to the limit: p50 {lat['p50'] / bare['p50']:.2f}x, "
          f"p99 {lat['p99'] / bare['p99']:.2f}x   (goal: p50 < 1 ms, p99 < 3 ms)")
    print(f"sustained: {rate:,.0f} lookups/s with {args.clients} concurrent client processes "
          f"({total} lookups in {args.seconds:.0f} s)")
    return 0
