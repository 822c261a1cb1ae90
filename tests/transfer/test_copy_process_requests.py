"""The copier boundary between the server and a GPU's copy process, on CPU memory: what
`RemoteCudaCopier` sends for an operation and what the copy process makes of it, with
the CUDA copier replaced by memcpy (the CUDA copies themselves: tests/gpu)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvdepot.errors import InvalidRequest, ServerError
from kvdepot.protocol import LayerSpec
from kvdepot.transfer.copy_process import main, wire
from kvdepot.transfer.copy_process.client import RemoteCudaCopier
from kvdepot.transfer.cpu_copier import copy_blocks
from kvdepot.transfer.engine_layout import EngineLayout
from kvdepot.transfer.group_copy import GroupCopy, PoolExtents
from kvdepot.transfer.host_chunks import HostChunks
from kvdepot.transfer.layout import CopyPlan

BLOCK = 16
BLOCKS_PER_CHUNK = 2
NUM_BLOCKS = 8
LABEL = 7


class _Finished:
    """A completion event that has already happened."""

    def synchronize(self) -> None:
        pass


class _MemcpyQueue:
    """Stands in for `CudaCopier` in the copy process: copies at once, with memcpy."""

    def __init__(self, engine: list[np.ndarray]) -> None:
        self.engine = engine
        self.queued: list[int] = []
        """The group of each plan queued, in order."""

    def queue(self, plan: CopyPlan, hosts: HostChunks, event_handle: bytes | None,
              to_host: bool) -> _Finished | None:
        if not len(plan.block_ids):
            return None
        self.queued.append(plan.group)
        copy_blocks(self.engine, plan, [t.numpy() for t in hosts.each], to_host)
        return _Finished()

    def close(self) -> None:
        pass


class _CopyProcessInline:
    """A `CopyProcess` of the client that hands each request, through the wire format,
    straight to the copy process's own request handling."""

    def __init__(self, process: main.CopyProcess) -> None:
        self.process = process
        self.copies: list[wire.Copy] = []

    def running(self, device: int) -> _CopyProcessInline:
        return self

    def call(self, request: wire.Request) -> None:
        decoded = wire.REQUESTS.decode(framed_bytes(request))
        if isinstance(decoded, wire.Copy):
            self.copies.append(decoded)
            for done in self.process._queue(decoded):
                done.synchronize()


def framed_bytes(request: wire.Request) -> bytes:
    """`request` as it arrives at the copy process: sent and received over a channel."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        wire.send(ours, request)
        return wire.receive(theirs)


def _layers() -> list[LayerSpec]:
    """Two KV cache groups, each a `[blocks, 16 tokens, 8]` uint8 layer of its own."""
    return [LayerSpec(f"g{g}", g, "uint8", [NUM_BLOCKS, BLOCK, 8], [BLOCK * 8, 8, 1], 0, 0,
                      group=g) for g in range(2)]


@pytest.fixture
def boundary() -> Iterator[tuple[RemoteCudaCopier, _CopyProcessInline, _MemcpyQueue,
                                 EngineLayout, np.ndarray]]:
    layout = EngineLayout(_layers(), [NUM_BLOCKS * BLOCK * 8] * 2, BLOCK)
    engine = [np.random.default_rng(g).integers(0, 256, NUM_BLOCKS * BLOCK * 8,
                                                dtype=np.uint8) for g in range(2)]
    pool = torch.zeros(1 << 14, dtype=torch.uint8)
    channel, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    process = main.CopyProcess(0, pool, [channel])
    copier = _MemcpyQueue(engine)
    process.engines[LABEL] = main._Engine(copier, layout)  # type: ignore[arg-type]
    inline = _CopyProcessInline(process)
    registration = SimpleNamespace(allocations=[], layers=_layers(), block_size=BLOCK)
    remote = RemoteCudaCopier(inline, 0, LABEL, registration)  # type: ignore[arg-type]
    yield remote, inline, copier, layout, pool.numpy()
    process.waiters.shutdown()
    channel.close()
    other.close()


def _group_copies(layout: EngineLayout, pool: np.ndarray, ids: list[list[int]],
                  chunk_starts: list[int], first_slots: tuple[int, int] = (0, 0)
                  ) -> list[GroupCopy]:
    """Per group, its plan and its part of each chunk starting at `chunk_starts`."""
    within = layout.group_offsets(BLOCKS_PER_CHUNK)
    return [GroupCopy(group.plan(np.array(ids[g]), BLOCKS_PER_CHUNK, first_slots[g]),
                      PoolExtents(pool, np.array(chunk_starts) + within[g],
                                  BLOCKS_PER_CHUNK * group.block_bytes))
            for g, group in enumerate(layout.groups)]


def test_one_message_carries_every_group_and_the_bytes_arrive_exactly(boundary) -> None:
    remote, inline, copier, layout, pool = boundary
    chunk = layout.block_bytes * BLOCKS_PER_CHUNK
    starts = [3 * chunk, chunk]  # the tier hands chunks out anywhere in the pool
    stored = _group_copies(layout, pool, [[5, 1, 2, 6], [0, 3, 7, 4]], starts)
    remote.gather(stored, b"\1" * 64)
    assert len(inline.copies) == 1
    sent = inline.copies[0]
    assert (sent.to_host, sent.blocks_per_chunk, sent.event_handle) == (True, 2, b"\1" * 64)
    assert [g.group for g in sent.groups] == [0, 1] == copier.queued
    for g, part in enumerate(sent.groups):
        offsets = np.frombuffer(part.chunk_offsets, dtype=np.int64).tolist()
        assert offsets == [s + layout.group_offsets(BLOCKS_PER_CHUNK)[g] for s in starts]
        assert part.chunk_bytes == BLOCKS_PER_CHUNK * layout.groups[g].block_bytes
    for g, ids in enumerate([[5, 1, 2, 6], [0, 3, 7, 4]]):
        for view, (a, b) in zip(stored[g].extents.views(), [ids[:2], ids[2:]], strict=True):
            per_block = layout.groups[g].block_bytes
            want = np.concatenate([copier.engine[g][i * per_block:(i + 1) * per_block]
                                   for i in (a, b)])
            assert np.array_equal(view, want)

    # Back into other blocks; group 0 skips its first slot, group 1 has nothing to load.
    before = [e.copy() for e in copier.engine]
    loaded = _group_copies(layout, pool, [[4, 0, 3, 7], [1, 2, 5, 6]], starts,
                           first_slots=(1, 4))
    copier.queued.clear()
    remote.scatter(loaded)
    assert [g.group for g in inline.copies[1].groups] == [0] == copier.queued
    per_block = layout.groups[0].block_bytes

    def block_bytes(memory: np.ndarray, block: int) -> np.ndarray:
        return memory[block * per_block:(block + 1) * per_block]

    # Slot s of the retrieve reads what slot s of the store wrote (block [5, 1, 2, 6][s]);
    # slot 0 is skipped, so block 4 keeps its bytes.
    expected = {4: block_bytes(before[0], 4), 0: block_bytes(before[0], 1),
                3: block_bytes(before[0], 2), 7: block_bytes(before[0], 6)}
    for block, want in expected.items():
        assert np.array_equal(block_bytes(copier.engine[0], block), want)
    assert np.array_equal(copier.engine[1], before[1])


def test_an_operation_with_nothing_to_copy_sends_nothing(boundary) -> None:
    remote, inline, _, layout, pool = boundary
    remote.scatter(_group_copies(layout, pool, [[1, 2], [3, 4]], [0], first_slots=(2, 2)))
    assert inline.copies == []


def test_a_bad_request_queues_no_group(boundary) -> None:
    _, inline, copier, layout, _ = boundary
    process = inline.process
    good = wire.GroupCopy(0, np.array([1, 2], dtype=np.int64).tobytes(), 0,
                          np.array([0], dtype=np.int64).tobytes(),
                          BLOCKS_PER_CHUNK * layout.groups[0].block_bytes)
    outside = wire.GroupCopy(1, good.block_ids, 0, np.array([1 << 20]).tobytes(),
                             good.chunk_bytes)
    missing = wire.GroupCopy(2, good.block_ids, 0, good.chunk_offsets, good.chunk_bytes)
    for groups, error in (([good, outside], ServerError), ([good, missing], InvalidRequest),
                          ([good, good], InvalidRequest)):
        with pytest.raises(error):
            process._queue(wire.Copy(LABEL, True, BLOCKS_PER_CHUNK, groups, b""))
    assert copier.queued == []
