"""The lookup walk: where a LOOKUP's path through the server calls against the import graph.

    PYTHONPATH=src python scripts/lookup_walk.py

Builds the module import graph of src/kvdepot (lazy imports inside functions included) and
gives each module its floor: one more than the highest floor among the modules it imports
(a module importing nothing of kvdepot is on floor 1). Then it runs, in this process, one
LOOKUP that promotes its prompt from every lower tier, wired as `kvdepot serve` wires them
(CPU memory with both tier listeners, the disk tier, the shared tier on a redis-server of
its own when one is on $PATH, the KV event publisher, the block event log), records every
call from one kvdepot module into another, and prints each distinct call that climbs back
up: into a module on a higher floor than the caller's, which only a callback or an object
handed down can do. The router's call into the depot is counted from the router's code
(`RouterServer._serve_one` calls its dispatcher), not traced. docs/design.md, "The lookup
walk", says which climbs remain and why.
"""

from __future__ import annotations

import ast
import functools
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each kvdepot module and the kvdepot modules it imports anywhere in its code."""
    modules = {module_name(path): path for path in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:  # `from kvdepot.server import depot` names a module
                    child = f"{node.module}.{alias.name}"
                    found.add(child if child in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


GRAPH = import_graph()


@functools.cache
def floor(module: str) -> int:
    return 1 + max((floor(imported) for imported in GRAPH.get(module, ())), default=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def traced_lookup() -> list[tuple[str, str, str]]:
    """(caller module, callee function, callee module) of every call between two kvdepot
    modules while one LOOKUP promotes its prompt, in order."""
    import numpy as np
    import torch

    from kvdepot.keys import iter_prefix_keys, scope_root
    from kvdepot.metrics import MetricsRegistry
    from kvdepot.options import DEFAULTS
    from kvdepot.protocol import KeyScope, Lookup, QueryPrefetchStatus, RequestType, pack_ints
    from kvdepot.rpc.auth import ANONYMOUS, Caller, ServerAuth
    from kvdepot.rpc.credentials import NULL
    from kvdepot.server.assembly import assemble_depot
    from kvdepot.server.block_event_log import BlockEventLog, TierListeners
    from kvdepot.server.kv_event_publisher import KVEventPublisher
    from kvdepot.storage.cpu_tier import CPUTier
    from kvdepot.storage.disk_tier import DiskTier
    from kvdepot.storage.tier import LowerTier

    chunk = DEFAULTS.chunk_size
    metrics = MetricsRegistry()
    events = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}",
                              f"tcp://127.0.0.1:{free_port()}", chunk, ServerAuth(NULL, None))
    block_events = BlockEventLog(dropped=metrics.counter("block_events_dropped"))
    listeners = TierListeners(events, block_events)
    lower: list[LowerTier] = [DiskTier(tempfile.mkdtemp(), 1 << 26, listener=listeners)]
    redis = None
    if shutil.which("redis-server"):
        from kvdepot.storage.shared.address import parse_shared_tier_url
        from kvdepot.storage.shared.tier import SharedTier

        port = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(port), "--save", "",
                                  "--appendonly", "no"], stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        lower.append(SharedTier(parse_shared_tier_url(f"redis://127.0.0.1:{port}"), ttl=600,
                                timeout=2, piece_bytes=4 << 20, metrics=metrics))
    else:
        print("no redis-server on $PATH: the walk leaves out the shared tier")
    tier = CPUTier(torch.zeros(1 << 22, dtype=torch.uint8),
                   evictions=metrics.counter("evictions"), listener=listeners)
    depot = assemble_depot(DEFAULTS.resolved(copy_processes=False), tier, metrics, lower,
                           events=events, block_events=block_events)
    tokens = np.arange(4 * chunk, dtype=np.int32)
    scope = KeyScope(model="m", world_size=1)
    # The prompt's chunks lie half on disk, half in the shared tier: both are read.
    for i, keys in enumerate(iter_prefix_keys(scope_root(scope, ""), tokens, chunk, 4, 1)):
        lower[min(i // 2, len(lower) - 1)].write(keys[0], b"fp", memoryview(bytes(4096)))
    time.sleep(0.2)

    calls: list[tuple[str, str, str]] = []

    def module_of(frame: FrameType | None) -> str:
        return "" if frame is None else frame.f_globals.get("__name__", "")

    def on_call(frame: FrameType, event: str, _: Any) -> None:
        callee = module_of(frame)
        if event != "call" or not callee.startswith("kvdepot"):
            return
        caller = frame.f_back
        while caller is not None and not module_of(caller).startswith("kvdepot"):
            caller = caller.f_back  # through the standard library: a thread pool, say
        if caller is not None and module_of(caller) != callee:
            calls.append((module_of(caller), frame.f_code.co_name, callee))

    caller = Caller(b"\0conn", ANONYMOUS)
    sys.setprofile(on_call)
    threading.setprofile(on_call)
    try:
        hit = depot.handle(RequestType.LOOKUP, Lookup("walk", scope, pack_ints(tokens.tolist())),
                           caller)
        for _ in range(500):
            if hit is not None:
                break
            time.sleep(0.01)
            hit = depot.handle(RequestType.QUERY_PREFETCH_STATUS, QueryPrefetchStatus("walk"),
                               caller)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        depot.close()
        if redis is not None:
            redis.terminate()
    print(f"the lookup hit {hit} of 4 chunks")
    return calls


def main() -> int:
    calls = [("kvdepot.rpc.router", "handle", "kvdepot.server.depot"), *traced_lookup()]
    visited = list(dict.fromkeys(callee for _, _, callee in calls))
    print("modules of the walk, in the order first reached:")
    print("  " + " -> ".join(visited))
    climbs = [call for call in dict.fromkeys(calls) if floor(call[2]) > floor(call[0])]
    print(f"calls that climb back up (to a higher floor): {len(climbs)}")
    for caller, function, callee in climbs:
        print(f"  {caller} (floor {floor(caller)}) -> {callee}.{function} (floor {floor(callee)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
