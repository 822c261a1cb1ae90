"""No stale work on the GPU data path (the CPU version: tests/integration/test_stale_work.py).

The server is SIGSTOPped before it reads a store and a retrieve; the worker (heartbeat 1 s)
gives up on both, the engine reuses the store's blocks and recomputes the retrieve's, and
the server is continued. The fence must keep both from running: the recomputed blocks stay
as they are and the stored tokens are either missing or hold the original bytes.
"""

from __future__ import annotations

import os
import random
import signal

from kvdepot.integrations.vllm.mp_adapter import LoadStoreOp
from kvdepot.testbed.server_process import ServerProcess
from tests.gpu.support.engine import BLOCKS_PER_CHUNK, CHUNK, Engine
from tests.gpu.support.kv_layouts import same_bits
from tests.support.waiting import wait_until


def test_gpu_work_given_up_during_a_stall_never_runs_afterwards(server: ServerProcess) -> None:
    engine = Engine(server.url, "flash_attn", heartbeat_interval=1.0)
    try:
        rng = random.Random(5)
        cached = [rng.randrange(1, 30000) for _ in range(CHUNK)]
        stored = [rng.randrange(1, 30000) for _ in range(CHUNK)]
        n = BLOCKS_PER_CHUNK
        source, store_blocks, load_blocks, target = (
            list(range(i * n, (i + 1) * n)) for i in range(4))
        engine.fill(source, 1)
        engine.store(cached, source)
        engine.fill(store_blocks, 2)
        original = engine.snapshot(store_blocks)
        before = server.stats()
        pid = server.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            store_id = engine.store(stored, store_blocks, wait=False)
            engine.adapter.submit_retrieve_request(
                "stale-load", LoadStoreOp(token_ids=cached, block_ids=load_blocks, start=0,
                                          end=CHUNK), engine.event())
            sending: set[str] = set()
            recving: set[str] = set()

            def both_reported() -> bool:
                s, r = engine.adapter.get_finished({store_id})
                sending.update(s)
                recving.update(r)
                return store_id in sending and "stale-load" in recving

            wait_until(both_reported, "the worker giving up on the stopped server")
            assert engine.adapter.get_block_ids_with_load_errors() == set(load_blocks)
            engine.fill(store_blocks, 3)  # reused by vLLM
            engine.fill(load_blocks, 4)  # recomputed by vLLM
            recomputed = engine.snapshot(load_blocks)
        finally:
            os.kill(pid, signal.SIGCONT)

        def handled() -> bool:
            now = server.stats()
            return (now["stores"] + now["store_errors"]
                    >= before["stores"] + before["store_errors"] + 1
                    and now["retrieves"] + now["retrieve_errors"]
                    >= before["retrieves"] + before["retrieve_errors"] + 1)

        wait_until(handled, "the server handling the stale operations")
        wait_until(lambda: engine.adapter.is_healthy, "recovery")
        assert all(same_bits(a, b) for a, b in zip(recomputed, engine.snapshot(load_blocks),
                                                    strict=True)), \
            "a retrieve the worker gave up on ran later, over the recomputed blocks"
        try:
            engine.retrieve(stored, target)
        except RuntimeError:
            pass  # a miss: the stale store stored nothing
        else:
            assert all(same_bits(a, b) for a, b in zip(original, engine.snapshot(target),
                                                        strict=True)), \
                "a store the worker gave up on ran later and saved the reused blocks' bytes"
        assert server.stats()["cancelled_operations"] - before["cancelled_operations"] == 2
    finally:
        engine.close()
