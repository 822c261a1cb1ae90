"""The copy process of one GPU: `python -m kvdepot.transfer.copy_process.main`.

Started by the server (`client.CopyProcess`) with the shared pool's memfd and its ends
of the channels. Its main thread reads requests from every channel and queues each
operation's copies right away, every KV cache group of it (it is the only thread that
queues work on the GPU); a waiter thread per request in flight waits for the copies'
completion events (a retrieve's by asking, `RETRIEVE_POLL_SECONDS`) and sends the
reply. It exits when its channels close: when the server stops, or dies (the kernel
closes a dead process's sockets). PR_SET_PDEATHSIG would not do: it fires when the
thread that started the child ends, and the server starts them from short-lived threads.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import selectors
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvdepot.errors import InvalidRequest, KVDepotError, ServerError
from kvdepot.transfer.copy_process import wire
from kvdepot.transfer.cuda_copier import CudaCopier
from kvdepot.transfer.cuda_ipc_mapping import open_copier
from kvdepot.transfer.engine_layout import EngineLayout
from kvdepot.transfer.host_chunks import HostChunks
from kvdepot.transfer.host_pool import map_shared_pool, page_lock
from kvdepot.transfer.layout import CopyPlan

log = logging.getLogger("kvdepot.copy_process")

FAILED_STATUS = 70
"""Exit status after an unexpected error (EX_SOFTWARE)."""

RETRIEVE_POLL_SECONDS = 50e-6
"""How often a retrieve's waiter asks whether its copies are done. Its engine waits for
the reply: a thread sleeping on a CUDA event wakes a good while after the GPU is done,
and one asking at this pace soon after (docs/design.md), at the cost of a wake-up
per interval while a load is in flight (its CPU share not yet measured). A store's
waiter sleeps on its events: nothing waits for its reply."""


class _Engine:
    """One registration as the copy process holds it."""

    def __init__(self, copier: CudaCopier, layout: EngineLayout) -> None:
        self.copier = copier
        self.layout = layout


class CopyProcess:
    """The registrations open on GPU `device`, and the loop serving the server's requests."""

    def __init__(self, device: int, pool: torch.Tensor, channels: list[socket.socket]) -> None:
        self.device = device
        self.pool = pool
        self.channels = channels
        self.engines: dict[int, _Engine] = {}
        # One waiter per channel is enough: a channel has one request in flight.
        self.waiters = ThreadPoolExecutor(len(channels), thread_name_prefix="kvdepot-wait")

    def serve(self) -> None:
        selector = selectors.DefaultSelector()
        for channel in self.channels:
            selector.register(channel, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in selector.select():
                    channel: socket.socket = key.fileobj  # type: ignore[assignment]
                    try:
                        body, fds = wire.receive_with_fds(channel)
                    except (wire.ChannelClosed, OSError):
                        return  # the server closed its end or exited
                    try:
                        self._handle(channel, body, fds)
                    finally:
                        # Imported by now, or refused: the mappings hold the memory.
                        for fd in fds:
                            os.close(fd)
        finally:
            self.close()

    def close(self) -> None:
        self.waiters.shutdown(wait=True)
        for engine in self.engines.values():
            engine.copier.close()
        self.engines.clear()

    def _handle(self, channel: socket.socket, body: bytes, fds: list[int]) -> None:
        try:
            request = wire.REQUESTS.decode(body)
            if isinstance(request, wire.Copy):
                done = self._queue(request)
                if done:
                    poll = None if request.to_host else RETRIEVE_POLL_SECONDS
                    self.waiters.submit(_wait_and_reply, channel, done, poll)
                    return
            elif isinstance(request, wire.Open):
                self._open(request, fds)
            else:
                engine = self.engines.pop(request.engine, None)
                if engine is not None:
                    engine.copier.close()
            outcome = wire.Outcome()
        except Exception as exc:
            outcome = _failure(exc)
        _reply(channel, outcome)

    def _open(self, request: wire.Open, fds: list[int]) -> None:
        if len(fds) != len(request.vmm_fd_indices):
            raise ServerError(f"an Open named {len(request.vmm_fd_indices)} descriptors and "
                              f"carried {len(fds)}")
        copier = open_copier(request.allocations, self.device,
                             dict(zip(request.vmm_fd_indices, fds, strict=True)))
        try:
            sizes = [int(t.numel()) for t in copier.allocations]
            layout = EngineLayout(request.layers, sizes, request.block_size)
            if copier.mode != "dma":  # only the staged path runs kernels
                copier.warm_up(layout.groups)
        except BaseException:
            copier.close()
            raise
        previous = self.engines.pop(request.engine, None)
        if previous is not None:
            previous.copier.close()
        self.engines[request.engine] = _Engine(copier, layout)

    def _queue(self, request: wire.Copy) -> list[torch.cuda.Event]:
        """Queue every group's copies of `request`; the events recorded after them (none:
        nothing to copy). Nothing is queued unless every group is sound."""
        engine = self.engines.get(request.engine)
        if engine is None:
            raise ServerError(f"engine #{request.engine} is not open in this copy process")
        groups = engine.layout.groups
        if request.blocks_per_chunk <= 0:
            raise InvalidRequest(f"{request.blocks_per_chunk} blocks per chunk")
        if len({g.group for g in request.groups}) != len(request.groups):
            raise InvalidRequest("a KV cache group appears twice in one copy")
        work: list[tuple[CopyPlan, HostChunks]] = []
        for part in request.groups:
            if not 0 <= part.group < len(groups):
                raise InvalidRequest(f"KV cache group {part.group} does not exist")
            ids = np.frombuffer(part.block_ids, dtype=np.int64)
            plan = CopyPlan(groups[part.group], ids, request.blocks_per_chunk, part.first_slot)
            size = part.chunk_bytes
            offsets = np.frombuffer(part.chunk_offsets, dtype=np.int64).tolist()
            if any(o < 0 or o + size > self.pool.numel() for o in offsets):
                raise ServerError("a chunk lies outside the shared pool")
            chunks_touched = -(-(part.first_slot + len(ids)) // request.blocks_per_chunk)
            if (len(offsets) < chunks_touched
                    or size < request.blocks_per_chunk * plan.layout.block_bytes):
                raise ServerError(f"KV cache group {part.group}'s chunks are fewer or smaller "
                                  "than its blocks")
            work.append((plan, HostChunks(self.pool, offsets, size)))
        event_handle = request.event_handle or None
        done: list[torch.cuda.Event] = []
        try:
            for plan, hosts in work:
                event = engine.copier.queue(plan, hosts, event_handle, request.to_host)
                if event is not None:
                    done.append(event)
        except BaseException:
            # The error is reported at once, and the server then frees (or hands back) the
            # chunks: no group queued before it may still be copying by then.
            for event in done:
                event.synchronize()
            raise
        return done


def _failure(exc: Exception) -> wire.Outcome:
    """The reply to a request that failed with a kvdepot error (a bad request, an engine
    that unregistered); anything else ends the process (`FAILED_STATUS`)."""
    if isinstance(exc, KVDepotError):
        return wire.Outcome(int(exc.kind), str(exc))
    # Most likely a CUDA error, and many of those poison the context for good: every
    # later copy here would fail too. Exiting fails the copies in flight, which the
    # engines recompute, and the server's next copy starts a clean process.
    log.critical("the copy process exits after an unexpected error", exc_info=exc)
    logging.shutdown()
    os._exit(FAILED_STATUS)


def _reply(channel: socket.socket, outcome: wire.Outcome) -> None:
    with contextlib.suppress(OSError):  # the server is gone; the main loop sees it
        wire.send(channel, outcome)


def _wait_and_reply(channel: socket.socket, done: list[torch.cuda.Event],
                    poll_seconds: float | None = None) -> None:
    """Reply once every event of `done` has completed: asking every `poll_seconds`, or
    (None) sleeping on each. A CUDA error either way becomes the reply (`_failure`)."""
    try:
        for event in done:
            if poll_seconds is not None:
                while not event.query():
                    time.sleep(poll_seconds)
            event.synchronize()
        outcome = wire.Outcome()
    except Exception as exc:
        outcome = _failure(exc)
    _reply(channel, outcome)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", type=int, required=True)
    parser.add_argument("--pool-fd", type=int, required=True)
    parser.add_argument("--pool-bytes", type=int, required=True)
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--channels", required=True, help="comma-separated socket fds")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    channels = [socket.socket(fileno=int(fd)) for fd in args.channels.split(",")]
    torch.cuda.set_device(args.device)
    pool = map_shared_pool(args.pool_fd, args.pool_bytes)
    os.close(args.pool_fd)
    if not args.no_pin:
        page_lock(pool)
    wire.send(channels[0], wire.Ready(os.getpid(), torch.cuda.get_device_name(args.device)))
    CopyProcess(args.device, pool, channels).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
