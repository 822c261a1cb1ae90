"""Issue 24, part 2: keys name the weights. Two seeded checkpoints of one architecture
(same config, same safetensors headers, other weights) are written at the same path in
turn, as an operator writes a new fine-tune over a model folder; real vLLM engines
compute the scope from vLLM's own config.

- After the swap, neither the disk tier (across a server restart) nor the shared tier
  (on another node) hands the old weights' KV to the new ones.
- The same weights at two paths on two nodes share chunks when the operator says so
  (`kvdepot.model_identity`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvdepot.testbed.checkpoint import seeded_checkpoint
from kvdepot.testbed.server_process import ServerProcess
from tests.e2e.support.harness import (
    CHUNK,
    MODEL_CONFIG,
    Engine,
    assert_same_output,
    close_engines,
    delta,
    eventually,
    tokens,
)
from tests.support.server import ForkedServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

DOCUMENT = tokens(2401, 4 * CHUNK + 30)
CHUNKS = 4
PIECES = CHUNKS + 1
"""What the shared tier is written and read for DOCUMENT: its chunks and its 30-token tail."""


def node(log_dir: Path, name: str, *extra: str) -> ServerProcess:
    return ForkedServerProcess(chunk_size=CHUNK, l1_size="1GiB", extra=extra,
                         output=log_dir / f"server-{name}.log").start()


def write_model(source: Path, target: Path) -> None:
    """Write `source`'s checkpoint at `target` the way an operator does: new files."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, copy_function=shutil.copyfile)


def test_swapped_weights_miss_the_disk_and_the_shared_tier(tmp_path: Path, log_dir: Path,
                                                          redis_server) -> None:
    old_weights = seeded_checkpoint(MODEL_CONFIG, seed=11)
    new_weights = seeded_checkpoint(MODEL_CONFIG, seed=12)
    model = tmp_path / "models" / "llama"
    write_model(old_weights, model)
    # The very files, times kept: the fingerprint reads sizes, headers and modification
    # times, not the weights' bytes (kvdepot/integrations/vllm/model_identity.py).
    kept = tmp_path / "kept"
    shutil.copytree(model, kept, copy_function=shutil.copy2)
    disk = tmp_path / "disk"
    node_a = node(log_dir, "a", "--disk-path", str(disk), "--disk-size", "256MiB",
                  "--remote", f"redis://127.0.0.1:{redis_server.port}")
    node_b = node(log_dir, "b", "--remote", f"redis://127.0.0.1:{redis_server.port}")
    try:
        engine = Engine(model, node_a.url, log_dir / "engine-old-weights.log")
        try:
            before = node_a.stats()
            old = engine.generate([DOCUMENT])[0]
            eventually(node_a, lambda s: delta(s, before, "remote_written_chunks") == PIECES,
                       timeout=60)
        finally:
            engine.close()
        node_a.stop()  # drains: the disk tier has every chunk when it exits
        assert any(p.is_file() for p in disk.rglob("*")), "the disk tier holds nothing"

        write_model(new_weights, model)  # same path, same config, same headers
        node_a.start()  # the disk tier comes back with the old weights' chunks
        # Consumers only: neither stores the new weights' KV for the other to find.
        on_a = Engine(model, node_a.url, log_dir / "engine-new-a.log", kv_role="kv_consumer",
                      wait=False)
        on_b = Engine(model, node_b.url, log_dir / "engine-new-b.log", kv_role="kv_consumer",
                      wait=False)
        try:
            on_a.wait_ready()
            on_b.wait_ready()
            for engine, server in ((on_a, node_a), (on_b, node_b)):
                before = server.stats()
                new = engine.generate([DOCUMENT])[0]
                after = server.stats()
                assert delta(after, before, "lookups") >= 1  # it did ask
                assert delta(after, before, "hit_tokens") == 0
                assert delta(after, before, "promoted_chunks") == 0
                assert delta(after, before, "remote_read_chunks") == 0
                assert delta(after, before, "retrieved_chunks") == 0
                # The weights do differ: the old KV would have answered otherwise.
                assert new["token_ids"] != old["token_ids"]
        finally:
            close_engines(on_a, on_b)

        # The control: the old checkpoint's own files put back at the same path find
        # their chunks again (in A's disk tier), so the misses above came from the swap,
        # not from keys that never matched. One engine, on A, is the control for both
        # tiers: it shows that the same files give the same key scope again; that node B
        # finds what node A stored under one scope is tests/e2e/test_vllm_shared_tier.py's.
        shutil.rmtree(model)
        shutil.copytree(kept, model, copy_function=shutil.copy2)
        back = Engine(model, node_a.url, log_dir / "engine-old-again.log", kv_role="kv_consumer")
        try:
            before = node_a.stats()
            again = back.generate([DOCUMENT])[0]
            after = node_a.stats()
            # Found: loaded, or left to the engine as slower to load than to compute.
            found = (delta(after, before, "hit_tokens")
                     + delta(after, before, "disk_skipped_slower_chunks"))
            assert found > 0, after
            assert again["token_ids"] == old["token_ids"]
        finally:
            back.close()
    finally:
        node_a.stop()
        node_b.stop()


def test_same_weights_at_two_paths_share_with_the_operator_identity(
        tmp_path: Path, log_dir: Path, redis_server) -> None:
    weights = seeded_checkpoint(MODEL_CONFIG, seed=11)
    # Two nodes, two paths, copies written separately (their files' times differ).
    path_a, path_b = tmp_path / "node-a" / "llama", tmp_path / "node-b" / "weights"
    write_model(weights, path_a)
    write_model(weights, path_b)
    node_a = node(log_dir, "override-a", "--remote", f"redis://127.0.0.1:{redis_server.port}")
    node_b = node(log_dir, "override-b", "--remote", f"redis://127.0.0.1:{redis_server.port}")
    try:
        on_a = Engine(path_a, node_a.url, log_dir / "engine-override-a.log",
                      model_identity="llama-ft-2025-06", wait=False)
        on_b = Engine(path_b, node_b.url, log_dir / "engine-override-b.log",
                      model_identity="llama-ft-2025-06", wait=False)
        try:
            on_a.wait_ready()
            on_b.wait_ready()
            before = node_a.stats()
            reference = on_a.generate([DOCUMENT])[0]
            eventually(node_a, lambda s: delta(s, before, "remote_written_chunks") == PIECES,
                       timeout=60)
            before = node_b.stats()
            loaded = on_b.generate([DOCUMENT])[0]
            after = node_b.stats()
        finally:
            close_engines(on_a, on_b)
        assert delta(after, before, "remote_read_chunks") == PIECES
        assert delta(after, before, "retrieved_chunks") == CHUNKS
        assert_same_output(loaded, reference)
    finally:
        node_a.stop()
        node_b.stop()
