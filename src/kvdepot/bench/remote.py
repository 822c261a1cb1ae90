"""`kvdepot bench remote`: the shared tier's write-behind and promotion against a Redis
cluster, beside the raw redis-py limit measured in the same run on the same cluster.

Write-behind runs the server's own code path (`LowerTiers` over a `CPUTier` holding
committed chunks, `SharedTier` writing them); promotion reads them back into a second
`CPUTier` through `bring_up_run`, as a node-B lookup does, and checks every byte. The
limit is redis-py alone: pipelined SETs, then GETs, of the same bytes cut into the same
pieces under the same key names, through the same client, in pipelines of the tier's
write batches (64 MiB), with no checksum, header, copy or bookkeeping.
Without `--remote` it starts clusters of its own on loopback (`--masters`, 3 by default),
and beside each figure prints the same cluster's rate for a C client: `redis-benchmark`
driving every master at once (one thread per master) with values of the piece size.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvdepot.bench.remote_sizing import print_sizing
from kvdepot.options import DEFAULTS
from kvdepot.sizes import format_size, parse_size
from kvdepot.testbed.measurement import in_spawned_process, machine

WARM_UP_TOKENS = 1024
"""Each `--ttft` engine's warm-up prompt: a few steps of it give the connector its
prefill rate before the measured requests."""


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("remote", help="shared tier: write-behind and promotion GB/s vs redis-py")
    p.add_argument("--shared-tier", "--remote", dest="remote", default=None,
                   help="a redis:// or redis+cluster:// URL to measure (default: start a "
                        "3-master cluster on loopback)")
    p.add_argument("--masters", default="3",
                   help="masters of the clusters it starts, comma-separated to compare several "
                        "(default %(default)s)")
    p.add_argument("--io-threads", type=int, default=1,
                   help="io-threads of the servers it starts (default %(default)s)")
    p.add_argument("--connections-per-master", type=int, default=None,
                   help="connections the tier uses on each master at once (default: the "
                        "tier's own)")
    p.add_argument("--replicas", type=int, default=0,
                   help="replicas per master of the cluster it starts (default %(default)s)")
    p.add_argument("--chunk-size", type=parse_size, default=32 << 20,
                   help="bytes per chunk (default 32MiB: Llama-3.1-8B, 256 tokens, bf16)")
    p.add_argument("--chunks", type=int, default=16, help="chunks per run (0: TTFT only)")
    p.add_argument("--piece-sizes", default="1MiB,4MiB,16MiB",
                   help="piece sizes to compare (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure; the best is kept")
    p.add_argument("--ttft", action="store_true",
                   help="also the TTFT of a real vLLM engine (CPU) on node B for a prompt node "
                        "A prefilled, beside cold and a local CPU hit (several minutes)")
    p.add_argument("--prompt-tokens", default="8192",
                   help="prompt lengths of --ttft, comma-separated (default %(default)s)")
    p.add_argument("--link-mbps", type=float, default=None,
                   help="--ttft with node B reaching a Redis of its own through a link of "
                        "this many MB/s (a throttling proxy on loopback); node A goes direct")
    p.set_defaults(run=run)


def _chunks(count: int, nbytes: int) -> tuple[Any, list[bytes]]:
    """A CPU tier holding `count` committed chunks of random bytes, and their keys."""
    from kvdepot.storage.cpu_tier import CPUTier
    from kvdepot.transfer.host_pool import allocate_pool

    memory = CPUTier(allocate_pool(count * nbytes + (64 << 20)))
    pool = memory.pool.numpy()
    rng = np.random.default_rng(1)
    keys = []
    for _ in range(count):
        key = os.urandom(34)
        _, chunk = memory.reserve(key, nbytes, b"bench-layout")
        assert chunk is not None
        pool[chunk.offset:chunk.offset + nbytes] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        memory.commit(chunk)
        keys.append(key)
    return memory, keys


def _tier(address: Any, piece: int, connections_per_master: int | None = None) -> Any:
    from kvdepot.storage.shared.tier import CONNECTIONS_PER_MASTER, SharedTier

    return SharedTier(address, ttl=3600, timeout=30, piece_bytes=piece,
                      connections_per_master=connections_per_master or CONNECTIONS_PER_MASTER)


def _flush(address: Any) -> None:
    from kvdepot.storage.shared.address import connect

    client = connect(address, 30)
    if address.cluster:
        client.flushall(target_nodes=client.PRIMARIES)
    else:
        client.flushall()
    client.close()


def _ours(address: Any, memory: Any, keys: list[bytes], nbytes: int, piece: int,
          connections_per_master: int | None = None) -> tuple[float, float]:
    """(write-behind s, promotion s) through the server's code path."""
    from kvdepot.storage.cpu_tier import CPUTier
    from kvdepot.storage.lower_tiers import LowerTiers
    from kvdepot.transfer.host_pool import allocate_pool

    _flush(address)
    writer = _tier(address, piece, connections_per_master)
    lower = LowerTiers(memory, [writer])
    started = time.perf_counter()
    lower.write_behind(keys)
    while writer.status()["written_chunks"] < len(keys):
        assert writer.available, writer.breaker.last_error
        time.sleep(0.005)  # coarse: a busy poll would take the GIL from the writer
    wrote = time.perf_counter() - started
    lower.close()

    node_b = CPUTier(allocate_pool(len(keys) * nbytes + (64 << 20)))
    reader = _tier(address, piece, connections_per_master)
    promote = LowerTiers(node_b, [reader])
    started = time.perf_counter()
    run = promote.bring_up_run([[key] for key in keys], 1)
    read = time.perf_counter() - started
    assert run == len(keys), f"only {run} of {len(keys)} chunks came back"
    a, b = memory.pool.numpy(), node_b.pool.numpy()
    for key in keys:
        (x,), (y,) = memory.pin([key]), node_b.pin([key])
        assert np.array_equal(a[x.offset:x.offset + nbytes], b[y.offset:y.offset + nbytes])
        memory.unpin([x])
        node_b.unpin([y])
    promote.close()
    return wrote, read


def _raw(address: Any, memory: Any, keys: list[bytes], nbytes: int, piece: int
         ) -> tuple[float, float]:
    """(SET s, GET s): redis-py pipelines of the same pieces under the tier's key names,
    through the same client, in pipelines of the tier's write batches."""
    from kvdepot.storage.shared import value
    from kvdepot.storage.shared.address import connect
    from kvdepot.storage.shared.tier import WRITE_PIPELINE_BYTES

    _flush(address)
    client = connect(address, 30)
    pool = memory.pool.numpy()
    chunks = memory.pin(keys)
    names = [value.piece_keys(key, value.piece_count(nbytes, piece)) for key in keys]
    started = time.perf_counter()
    per_pipe = max(1, WRITE_PIPELINE_BYTES // nbytes)
    for first in range(0, len(keys), per_pipe):
        pipe = client.pipeline(transaction=False)
        for chunk, chunk_names in zip(chunks[first:first + per_pipe],
                                      names[first:first + per_pipe], strict=True):
            view = memoryview(pool[chunk.offset:chunk.offset + nbytes])
            for i, name in enumerate(chunk_names):
                pipe.set(name, view[i * piece:(i + 1) * piece])
        pipe.execute()
    wrote = time.perf_counter() - started
    memory.unpin(chunks)
    started = time.perf_counter()
    per_pipe = max(1, WRITE_PIPELINE_BYTES // nbytes)
    for first in range(0, len(keys), per_pipe):
        pipe = client.pipeline(transaction=False)
        for chunk_names in names[first:first + per_pipe]:
            for name in chunk_names:
                pipe.get(name)
        values = pipe.execute()
        assert sum(len(v) for v in values) == nbytes * len(names[first:first + per_pipe])
    read = time.perf_counter() - started
    client.close()
    return wrote, read


def run(args: argparse.Namespace) -> int:
    from kvdepot.storage.shared.address import parse_shared_tier_url

    print(f"kvdepot bench remote: {machine()}")
    if args.remote:
        address = parse_shared_tier_url(args.remote)
        _measure(address, args.remote, args, None)
        return 0
    from kvdepot.testbed.redis_processes import RedisClusterProcesses

    for masters in (int(text) for text in args.masters.split(",")):
        with tempfile.TemporaryDirectory() as directory:
            # No memory limit ("0"): every run flushes first, and a limit near the data
            # (servers' own memory, the C client's keys) evicted pieces about to be read.
            cluster = RedisClusterProcesses(Path(directory), masters=masters,
                                            replicas=args.replicas, maxmemory="0",
                                            io_threads=args.io_threads)
            cluster.start()
            try:
                _measure(parse_shared_tier_url(cluster.url), cluster.url, args, cluster)
            finally:
                cluster.stop()
    return 0


def _measure(address: Any, url: str, args: argparse.Namespace, cluster: Any) -> None:
    nbytes, count = args.chunk_size, args.chunks
    masters = f", {cluster.masters} masters, io-threads {args.io_threads}" if cluster else ""
    if args.connections_per_master:
        masters += f", {args.connections_per_master} connections per master"
    print(f"  {address.display} ({_server(address)}){masters}, {count} chunks of "
          f"{format_size(nbytes)} ({format_size(nbytes * count)}), best of {args.repeats}")
    if count > 0:
        _rates(address, args, cluster)
    if args.ttft:
        _flush(address)
        _ttft(url, [int(size) for size in args.prompt_tokens.split(",")], args.link_mbps,
              cluster)


def _server(address: Any) -> str:
    """Which server and version answer (one of the nodes for a cluster): Valkey and
    Redis serve big values at different rates (docs/shared-tier.md)."""
    from kvdepot.storage.shared.address import connect

    client = connect(address, 30)
    try:
        if address.cluster:
            info = client.info("server", target_nodes=client.get_random_node())
        else:
            info = client.info("server")
    finally:
        client.close()
    if "valkey_version" in info:
        return f"Valkey {info['valkey_version']}"
    return f"Redis {info.get('redis_version', '?')}"


def _rates(address: Any, args: argparse.Namespace, cluster: Any) -> None:
    """Write-behind and promotion against raw redis-py and (on a cluster it started) the C
    client, per piece size."""
    nbytes, count = args.chunk_size, args.chunks
    total = nbytes * count
    memory, keys = _chunks(count, nbytes)
    best = 0.0
    print(f"  {'piece':>8} {'C SET':>6} {'raw SET':>8} {'write-behind':>13} {'/C':>5}"
          f" {'C GET':>6} {'raw GET':>8} {'promotion':>10} {'/C':>5}   (GB/s)")
    for text in args.piece_sizes.split(","):
        piece = parse_size(text)
        raw, ours, c_client = [], [], []
        for _ in range(args.repeats):  # interleaved: all see the same machine
            raw.append(_raw(address, memory, keys, nbytes, piece))
            ours.append(_ours(address, memory, keys, nbytes, piece, args.connections_per_master))
        if cluster is not None:
            _flush(address)
            c_client.append(_c_client(cluster, piece, total))
        raw_set = total / min(r[0] for r in raw) / 1e9
        raw_get = total / min(r[1] for r in raw) / 1e9
        wb = total / min(o[0] for o in ours) / 1e9
        pr = total / min(o[1] for o in ours) / 1e9
        c_set = max((c[0] for c in c_client), default=float("nan"))
        c_get = max((c[1] for c in c_client), default=float("nan"))
        print(f"  {format_size(piece):>8} {c_set:6.2f} {raw_set:8.2f} {wb:13.2f}"
              f" {wb / c_set:5.0%} {c_get:6.2f} {raw_get:8.2f} {pr:10.2f} {pr / c_get:5.0%}",
              flush=True)
        best = max(best, pr)
    print_sizing(best * 1e9)


C_CLIENT_NEW_KEYS = 1_000_000_000
"""Key space of the C client's SETs: each SET a new key, bar a rare repeat."""
C_CLIENT_SHAPES = ((1, 4), (2, 8), (8, 1))
"""(connections per master, commands in flight on each) of the C client's runs; the best
of them is the limit (on a 16-core host, 6 masters, the first read fastest and the last
wrote new keys fastest, each by far)."""
C_CLIENT_BYTES = 8
"""How many times the bench's bytes the C client moves each way per run. Its rate
includes its start (connections, the cluster's slot table): runs of 2x read 4.27 GB/s
from 6 masters whatever the shape, runs of 8x up to 11 (docs/shared-tier.md)."""


C_CLIENT_MIN_HITS = 0.9
"""Below this share of GETs that found their key, the C client's GET rate is no figure
(above it, the rate counts the hits only)."""


def _c_client(cluster: Any, piece: int, total: int) -> tuple[float, float]:
    """(SET GB/s, GET GB/s) of redis-benchmark over every master of `cluster` at once:
    cluster mode, one thread per master, values of `piece` bytes, `C_CLIENT_BYTES` times
    `total` bytes each way, the best of `C_CLIENT_SHAPES`.

    SETs go to an emptied cluster under new keys, as write-behind writes: overwriting a
    few keys again and again (as this bench did before) reuses their memory, and wrote
    twice as fast as new keys do. GETs read few keys (16 per master), so that the SETs
    before them have written nearly every key they read. A GET of a missing key moves
    nothing, so the GET rate counts only the GETs that hit (the masters'
    `keyspace_misses` tell the others), and a run whose GETs mostly missed gives no GET
    figure: valkey-benchmark 8.0's cluster mode reads other keys than its SETs wrote."""
    import subprocess

    from kvdepot.storage.shared.address import parse_shared_tier_url
    from kvdepot.testbed.redis_processes import BENCHMARK_VARIABLE, redis_benchmark_binary

    binary = redis_benchmark_binary()
    if binary is None:
        return float("nan"), float("nan")
    masters = cluster.masters
    if masters == 2:
        return float("nan"), float("nan")
    requests = max(64 * masters, C_CLIENT_BYTES * total // piece)
    # Its cluster mode refuses clusters of fewer than 3 nodes; one master is a plain
    # server to it (every key is that master's).
    mode = ["--cluster"] if masters >= 3 else []

    def measure(tests: str, keys: int, connections: int, in_flight: int) -> dict[str, float]:
        result = subprocess.run(
            [binary, *mode, "-h", "127.0.0.1", "-p", str(cluster.nodes[0].port),
             "-t", tests, "-d", str(piece), "-n", str(requests),
             "-c", str(connections * masters), "-P", str(in_flight), "-r", str(keys),
             "--threads", str(masters), "--csv"],
            check=True, capture_output=True, text=True, timeout=600)
        rates = {}
        for line in result.stdout.splitlines():
            fields = [field.strip('"') for field in line.split(",")]
            if fields[0] in ("SET", "GET"):
                rates[fields[0]] = float(fields[1]) * piece / 1e9
        return rates

    def misses() -> int:
        total_misses = 0
        for node in cluster.nodes:
            client = node.client()
            try:
                total_misses += int(client.info("stats")["keyspace_misses"])
            finally:
                client.close()
        return total_misses

    best = {"SET": 0.0, "GET": 0.0}
    best_hit = 0.0
    for shape in C_CLIENT_SHAPES:
        _flush(parse_shared_tier_url(cluster.url))
        new_keys = measure("set", C_CLIENT_NEW_KEYS, *shape)
        missed_before = misses()
        existing = measure("set,get", 16, *shape)
        hit = 1 - (misses() - missed_before) / requests
        best_hit = max(best_hit, hit)
        best["SET"] = max(best["SET"], new_keys.get("SET", 0.0))
        if hit >= C_CLIENT_MIN_HITS:
            best["GET"] = max(best["GET"], existing.get("GET", 0.0) * hit)
    if best_hit < C_CLIENT_MIN_HITS:  # said once, not once per shape
        print(f"  (the C client's GETs found {best_hit:.0%} of their keys: no GET figure "
              f"from {binary}; ${BENCHMARK_VARIABLE} picks another, e.g. redis-benchmark)")
    return best["SET"] or float("nan"), best["GET"] or float("nan")


def _engine_ttfts(model_dir: Path, url: str, max_len: int, warm_up: list[list[int]],
                  jobs: list[tuple[str, list[int]]], log_path: Path, out: Any) -> None:
    """In a fresh process: the warm-up prompts (a few decoded tokens each, so the connector
    measures the engine's prefill rate), then one request per job, each after vLLM's own
    prefix cache was emptied and on an idle node (`_wait_idle`); puts {label: (seconds,
    tokens loaded from kvdepot, bytes its server read from the shared tier, seconds that
    read took)}."""
    from kvdepot.client.admin import AdminClient
    from kvdepot.testbed.vllm_engine import (
        generate,
        make_engine,
        request_counting_loads,
        shutdown_engine,
    )

    llm = make_engine(model_dir, url, max_len, log_path)
    try:
        for prompt in warm_up:
            generate(llm, [prompt], 4)
        result = {}
        with AdminClient(url) as admin:
            for label, prompt in jobs:
                _wait_idle(admin)
                before = admin.stats()
                elapsed, _, loaded = request_counting_loads(llm, admin, prompt)
                after = admin.stats()
                result[label] = (elapsed, loaded,
                                 after["shared_read_bytes"] - before["shared_read_bytes"],
                                 after["shared_read_seconds"] - before["shared_read_seconds"])
    finally:
        shutdown_engine(llm)
    out.put(result)


def _wait_idle(admin: Any) -> None:
    """Until the server has no store or retrieve running and nothing left to write behind:
    the previous request's stores, and their write-behind, would otherwise share the
    node's cores and the cluster with the request measured next."""
    deadline = time.monotonic() + 600
    while True:
        stats = admin.stats()
        if stats["transfers_in_flight"] == 0 and stats["shared_write_queue_chunks"] == 0:
            return
        assert time.monotonic() < deadline, "the node never went idle"
        time.sleep(0.05)


def _ttft(redis_url: str, prompt_sizes: list[int], link_mbps: float | None,
          cluster: Any) -> None:
    """Node A's engine: cold, then a hit in A's CPU memory; node B's engine (after A's
    has stopped): a cold prompt of the same length, then A's prompt from the shared tier,
    then again from B's CPU memory. One engine at a time, each request on an idle node.
    With `link_mbps`, node B reaches a Redis of its own through a link of that many MB/s
    (A directly). On a `cluster` the bench started (no link), the C client's GET rate of
    that cluster gives each shared hit its floor: A's local hit plus the bytes B read at
    that rate. The C client runs first, so every master has served big replies before B
    reads, as the masters of a cluster in use have (and keep their pages:
    `ALLOCATOR_SETTINGS`); a new cluster's first replies fault their pages in."""
    import random

    from kvdepot.client.admin import AdminClient
    from kvdepot.client.scheduler import MIN_TAIL_TOKENS
    from kvdepot.testbed.checkpoint import LLAMA_CONFIG, seeded_checkpoint
    from kvdepot.testbed.measurement import server_process
    from kvdepot.testbed.redis_processes import RedisProcess
    from kvdepot.testbed.throttled_link import ThrottledLink
    from kvdepot.testbed.vllm_engine import random_tokens

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    model_dir = seeded_checkpoint(LLAMA_CONFIG)
    rng = random.Random(7)
    prompts = [random_tokens(rng, size) for size in prompt_sizes]
    fresh = [random_tokens(rng, size) for size in prompt_sizes]
    warm_up = [random_tokens(rng, WARM_UP_TOKENS) for _ in range(2)]
    max_len = max(*prompt_sizes, WARM_UP_TOKENS) + 256
    log_path = Path(tempfile.gettempdir()) / f"kvdepot-bench-remote-vllm-{os.getpid()}.log"
    link_text = f"node B behind a {link_mbps:g} MB/s link" if link_mbps else "no link limit"
    print(f"  TTFT, vLLM on CPU, {link_text} (warnings to {log_path}):", flush=True)
    c_get = float("nan")
    if cluster is not None and not link_mbps:
        from kvdepot.storage.shared.address import parse_shared_tier_url

        # Best of three; the cluster is emptied again after.
        c_get = max(_c_client(cluster, DEFAULTS.shared_tier_piece_bytes, 0)[1] for _ in range(3))
        _flush(parse_shared_tier_url(cluster.url))
        if math.isfinite(c_get):
            print(f"    C client (redis-benchmark GET, every master at once): {c_get:.2f} GB/s")
    with contextlib.ExitStack() as stack:
        url_a_remote = url_b_remote = redis_url
        if link_mbps:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            redis = RedisProcess(directory, maxmemory="8gb").start()
            stack.callback(redis.stop)
            link = stack.enter_context(ThrottledLink(("127.0.0.1", redis.port),
                                                     link_mbps * 1e6))
            url_a_remote, url_b_remote = f"redis://{redis.address}", f"redis://{link.address}"
        # As an operator of a slow link would (the server warns otherwise): room for a
        # piece of the default size to cross it twice within one round trip's timeout.
        timeout = DEFAULTS.shared_tier_timeout
        if link_mbps:
            timeout = max(timeout, 2 * DEFAULTS.shared_tier_piece_bytes / (link_mbps * 1e6))
        url_a, _ = stack.enter_context(server_process(256, "4GiB", ("--shared-tier", url_a_remote)))
        url_b, _ = stack.enter_context(server_process(
            256, "4GiB", ("--shared-tier", url_b_remote, "--shared-tier-timeout", f"{timeout:g}")))
        a = in_spawned_process(_engine_ttfts, model_dir, url_a, max_len, warm_up[:1],
                               [(f"cold {i}", p) for i, p in enumerate(prompts)]
                               + [(f"local {i}", p) for i, p in enumerate(prompts)], log_path)
        with AdminClient(url_a) as admin:
            deadline = time.monotonic() + 600
            # Whole chunks and, where a prompt ends far enough past its last one, a tail.
            wanted = (sum(size // 256 + (size % 256 >= MIN_TAIL_TOKENS) for size in prompt_sizes)
                      + WARM_UP_TOKENS // 256)
            while admin.stats()["shared_written_chunks"] < wanted:
                assert time.monotonic() < deadline, "node A's write-behind never finished"
                time.sleep(0.1)
        b = in_spawned_process(_engine_ttfts, model_dir, url_b, max_len, warm_up[1:],
                               [(f"cold {i}", p) for i, p in enumerate(fresh)]
                               + [(f"shared {i}", p) for i, p in enumerate(prompts)]
                               + [(f"local {i}", p) for i, p in enumerate(prompts)], log_path)
        with AdminClient(url_b) as admin:
            skipped = admin.stats()["shared_skipped_slower_chunks"]
    print(f"    {'prompt':>7} {'A cold':>8} {'A local':>8} {'B cold':>8} {'B shared':>9} "
          f"{'loaded':>7} {'read':>9} {'in':>7} {'floor':>7} {'/B cold':>8} {'/A local':>9} "
          f"{'/floor':>7}")
    for i, size in enumerate(prompt_sizes):
        cold, local = a[f"cold {i}"][0], a[f"local {i}"][0]
        cold_b, (shared, loaded, nbytes, reading) = b[f"cold {i}"][0], b[f"shared {i}"]
        floor = local + nbytes / (c_get * 1e9)
        floor_text, to_floor = ((f"{floor * 1e3:>5.0f}ms", f"{shared / floor:>6.2f}x")
                                if math.isfinite(floor) else (f"{'-':>7}", f"{'-':>7}"))
        print(f"    {size:>7} {cold * 1e3:>6.0f}ms {local * 1e3:>6.0f}ms {cold_b * 1e3:>6.0f}ms "
              f"{shared * 1e3:>7.0f}ms {loaded:>7} {format_size(nbytes):>9} "
              f"{reading * 1e3:>5.1f}ms {floor_text} "
              f"{shared / cold_b:>7.2f}x {shared / local:>8.2f}x {to_floor}")
    print("    read: the bytes B's server read from the shared tier for the shared hit, in: "
          "the time its reads took (shared_read_seconds)")
    if math.isfinite(c_get):
        print("    floor: A local plus the bytes B read from the shared tier at the C client's "
              "rate")
    print(f"    chunks node B left to its engine as slower to load than to compute: "
          f"{skipped:.0f}; goals: B shared / B cold <= 1.1 over a slow link and <= 0.2 "
          "(5x faster) over a fast one for long prompts, B shared / A local <= 1.2", flush=True)
