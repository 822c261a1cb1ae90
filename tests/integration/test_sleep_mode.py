"""Issue 24, part 1: vLLM 0.33's sleep mode.

Before it releases the KV memory, vLLM 0.33 calls the connector's `unregister_kv_caches`;
after wake-up, once the memory is mapped again, `restore_kv_caches`. These tests drive the
connector's worker side (`WorkerSide` over a real `WorkerClient`) against a real server
process the way vLLM 0.33 does, and check what the server holds through its stats and its
/proc entries: after unregister, no registration, no mapping of the KV memfd or of the
fence, no descriptor of either. After restore into memory at other addresses, a retrieve
writes the chunks stored before sleep into the new memory and nothing into the old.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import zmq

from kvdepot.client.engine_types import LoadStoreOp
from kvdepot.client.worker import WorkerClient
from kvdepot.integrations.vllm.metadata import KVDepotConnectorMetadata, TransferSpec
from kvdepot.integrations.vllm.worker_side import WorkerSide
from kvdepot.testbed.server_process import ServerProcess, child_pids
from tests.support.layouts import blocks, make_kv_caches
from tests.support.server import TEST_CHUNK_SIZE, running_server
from tests.support.waiting import wait_until

BLOCK = 16
NUM_BLOCKS = 32
CHUNKS = 2
TOKENS = [(7 * i + 3) % 5000 + 1 for i in range(CHUNKS * TEST_CHUNK_SIZE)]
SOURCE = list(range(CHUNKS * TEST_CHUNK_SIZE // BLOCK))
"""The blocks stored before sleep."""
TARGET = [b + len(SOURCE) for b in SOURCE]
"""The blocks retrieved into after wake-up."""
POISON = 0x5A
WAIT = 30.0


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    with running_server() as srv:
        yield srv


def make_worker(url: str) -> tuple[WorkerClient, WorkerSide]:
    client = WorkerClient(url, zmq.Context(), "sleep-model", vllm_block_size=BLOCK,
                          mq_timeout=WAIT, heartbeat_interval=0.5)
    side = WorkerSide(client, block_size=BLOCK, can_load=True, can_store=True,
                      preemption_wait_s=WAIT)
    return client, side


def new_caches(seed: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vLLM CPU's layout: per-layer views into one int8 allocation (returned first)."""
    caches = make_kv_caches("vllm_cpu", 2, NUM_BLOCKS, BLOCK, alias=False)
    raw = next(iter(caches.values())).untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8).set_(raw)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        whole.copy_(torch.randint(0, 256, whole.shape, generator=generator, dtype=torch.uint8))
    return whole, caches


def block_bits(caches: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    """Blocks `ids` of every layer as raw bits (random bytes include NaN patterns, which
    never compare equal as bfloat16)."""
    return [t.view(torch.int16) for t in blocks(caches, "vllm_cpu", ids)]


def spec(request_id: str, block_ids: list[int]) -> TransferSpec:
    return TransferSpec(request_id=request_id, token_ids=TOKENS, block_ids=[block_ids],
                        start=0, end=len(TOKENS))


def memfd_inodes(pid: int) -> set[int]:
    """Inodes of the kvdepot memfds process `pid` maps or holds open."""
    found: set[int] = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "memfd:kvdepot" in line:
                found.add(int(fields[4]))
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "memfd:kvdepot" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                found.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:  # closed while we looked
            continue
    return found


def server_memfds(server: ServerProcess) -> set[int]:
    """Every kvdepot memfd the server or one of its copy processes maps or holds."""
    found: set[int] = set()
    for pid in (server.pid, *child_pids(server.pid)):
        try:
            found |= memfd_inodes(pid)
        except FileNotFoundError:  # a child that exited meanwhile
            continue
    return found


def own_memfd(address: int, name: str) -> int:
    """The inode of this process's memfd `name` mapped at `address` (any, with 0)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or f"memfd:{name}" not in line:
                continue
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if address == 0 or low <= address < high:
                return int(fields[4])
    raise AssertionError(f"no memfd:{name} mapped here at {address:#x}")


def finish(side: WorkerSide, request_id: str, *, sending: bool) -> None:
    def done() -> bool:
        s, r = side.get_finished({request_id} if sending else set())
        return request_id in (s if sending else r)
    # A short interval: every step of these tests waits for its operations.
    wait_until(done, f"{request_id} finishing", timeout=WAIT, interval=0.005)


def test_unregister_releases_everything_and_restore_loads_into_new_memory(
        server: ServerProcess) -> None:
    client, side = make_worker(server.url)
    try:
        old_whole, old_caches = new_caches(seed=1)
        side.register_kv_caches(old_caches)
        assert server.stats()["registered_engines"] == 1
        kv_inode = own_memfd(old_whole.data_ptr(), "kvdepot-kv")
        fence_inode = own_memfd(0, "kvdepot-fence")
        held = server_memfds(server)
        assert {kv_inode, fence_inode} <= held, "the server should map both while registered"
        stored = block_bits(old_caches, SOURCE)

        # A store in flight when vLLM goes to sleep: unregister drains it first.
        meta = KVDepotConnectorMetadata(stores=[spec("before-sleep", SOURCE)],
                                        delayed_free_req_ids=["before-sleep"])
        side.on_metadata(meta)
        side.submit_stores(meta)
        side.unregister_kv_caches()
        side.unregister_kv_caches()  # idempotent, as vLLM's discard may call it again

        assert server.stats()["registered_engines"] == 0
        assert server.stats()["stored_chunks"] == CHUNKS, "the drain lost the store"
        wait_until(lambda: not ({kv_inode, fence_inode} & server_memfds(server)),
                   "the server unmapping and closing the old memfd and fence", timeout=5)
        assert client.instance_id == b"" and client.kv_caches == {}
        # The store is reported as vLLM expects once it polls again after wake-up.
        finish(side, "before-sleep", sending=True)

        # vLLM frees the old memory; ours stays alive only to prove nothing writes it.
        old_whole.fill_(POISON)
        new_whole, new_caches_ = new_caches(seed=None)
        new_whole.fill_(0)
        assert new_whole.data_ptr() != old_whole.data_ptr()

        side.restore_kv_caches(new_caches_)
        side.restore_kv_caches(new_caches_)  # idempotent
        assert server.stats()["registered_engines"] == 1
        new_inode = own_memfd(new_whole.data_ptr(), "kvdepot-kv")
        assert new_inode != kv_inode and new_inode in server_memfds(server)
        assert kv_inode not in server_memfds(server)

        load = KVDepotConnectorMetadata(loads=[spec("after-wake", TARGET)])
        side.start_loads(load)
        finish(side, "after-wake", sending=False)
        assert side.get_load_errors() == set(), "chunks stored before sleep must be hits"
        got = block_bits(new_caches_, TARGET)
        assert all(torch.equal(a, b) for a, b in zip(stored, got, strict=True))
        assert bool((old_whole == POISON).all()), "a retrieve wrote into the released memory"
        untouched = [b for b in range(NUM_BLOCKS) if b not in TARGET]
        assert all(bool((t == 0).all()) for t in block_bits(new_caches_, untouched))
    finally:
        side.shutdown()
    assert server.stats()["registered_engines"] == 0


def test_no_transfer_is_submitted_while_asleep(server: ServerProcess) -> None:
    client, side = make_worker(server.url)
    try:
        whole, caches = new_caches(seed=2)
        side.register_kv_caches(caches)
        stored = block_bits(caches, SOURCE)
        stored_meta = KVDepotConnectorMetadata(stores=[spec("warm", SOURCE)],
                                               delayed_free_req_ids=["warm"])
        side.on_metadata(stored_meta)
        side.submit_stores(stored_meta)
        finish(side, "warm", sending=True)
        before = server.stats()

        side.unregister_kv_caches()
        assert side.asleep
        whole.fill_(POISON)
        # A step planned while asleep (vLLM pauses scheduling, so only a race sends one).
        meta = KVDepotConnectorMetadata(loads=[spec("load-asleep", TARGET)],
                                        stores=[spec("store-asleep", SOURCE)],
                                        delayed_free_req_ids=["store-asleep"])
        side.on_metadata(meta)
        side.start_loads(meta)
        side.submit_stores(meta)
        # The load is failed at once, so vLLM recomputes its blocks; the store leaves
        # nothing pending, so vLLM may free its blocks.
        sending, recving = side.get_finished({"store-asleep"})
        assert recving == {"load-asleep"} and sending == {"store-asleep"}
        assert side.get_load_errors() == set(TARGET)
        assert not client.has_pending_store("store-asleep")

        after = server.stats()
        for counter in ("stores", "retrieves", "store_errors", "retrieve_errors"):
            assert after[counter] == before[counter], f"{counter} moved while asleep"
        assert bool((whole == POISON).all())

        # The client refuses on its own too: nothing reaches the server without a fence.
        client.submit_retrieve_request(
            "raw-asleep", LoadStoreOp(token_ids=TOKENS, block_ids=TARGET, start=0,
                                      end=len(TOKENS)), None)
        finish(side, "raw-asleep", sending=False)
        assert side.get_load_errors() == set(TARGET)
        assert server.stats()["retrieves"] == before["retrieves"]
        assert bool((whole == POISON).all())

        # Restored with the same tensors (vLLM's CuMem allocator maps the same
        # addresses): loads run again and find the chunks stored before sleep.
        side.restore_kv_caches()
        load = KVDepotConnectorMetadata(loads=[spec("load-awake", TARGET)])
        side.start_loads(load)
        finish(side, "load-awake", sending=False)
        assert side.get_load_errors() == set()
        assert server.stats()["retrieves"] == before["retrieves"] + 1
        got = block_bits(caches, TARGET)
        assert all(torch.equal(a, b) for a, b in zip(stored, got, strict=True))
    finally:
        side.shutdown()
