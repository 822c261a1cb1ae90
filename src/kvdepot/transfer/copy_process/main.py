"""The copy process of one GPU: `python -m kvdepot.transfer.copy_process.main`.

Started by the server (`client.CopyProcess`) with the shared pool's memfd and its ends
of the channels. Its main thread reads requests from every channel and queues each
copy right away (it is the only thread that talks to the GPU); a waiter thread per
request in flight waits for the copy's completion event and sends the reply. It exits
when its channels close: when the server stops, or dies (the kernel closes a dead
process's sockets). PR_SET_PDEATHSIG would not do: it fires when the thread that
started the child ends, and the server starts them from short-lived threads.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import selectors
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvdepot.errors import InvalidRequest, KVDepotError, ServerError
from kvdepot.storage.host_pool import map_shared_pool, page_lock
from kvdepot.transfer.copy_process import wire
from kvdepot.transfer.cuda_copier import CudaCopier
from kvdepot.transfer.cuda_ipc_mapping import open_copier
from kvdepot.transfer.engine_layout import EngineLayout
from kvdepot.transfer.layout import CopyPlan

log = logging.getLogger("kvdepot.copy_process")

FAILED_STATUS = 70
"""Exit status after an unexpected error (EX_SOFTWARE)."""


class _Engine:
    """One registration as the copy process holds it."""

    def __init__(self, copier: CudaCopier, layout: EngineLayout) -> None:
        self.copier = copier
        self.layout = layout


class CopyProcess:
    """The registrations open on GPU `device`, and the loop serving the server's requests."""

    def __init__(self, device: int, pool: torch.Tensor, channels: list[socket.socket]) -> None:
        self.device = device
        self.pool = pool.numpy()
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
                        body = wire.receive(channel)
                    except (wire.ChannelClosed, OSError):
                        return  # the server closed its end or exited
                    self._handle(channel, body)
        finally:
            self.close()

    def close(self) -> None:
        self.waiters.shutdown(wait=True)
        for engine in self.engines.values():
            engine.copier.close()
        self.engines.clear()

    def _handle(self, channel: socket.socket, body: bytes) -> None:
        try:
            request = wire.REQUESTS.decode(body)
            if isinstance(request, wire.Copy):
                done = self._queue(request)
                if done is not None:
                    self.waiters.submit(_wait_and_reply, channel, done)
                    return
            elif isinstance(request, wire.Open):
                self._open(request)
            else:
                engine = self.engines.pop(request.engine, None)
                if engine is not None:
                    engine.copier.close()
            outcome = wire.Outcome()
        except Exception as exc:
            outcome = _failure(exc)
        _reply(channel, outcome)

    def _open(self, request: wire.Open) -> None:
        copier = open_copier(request.allocations, self.device)
        try:
            sizes = [int(t.numel()) for t in copier.allocations]
            layout = EngineLayout(request.layers, sizes, request.block_size)
        except BaseException:
            copier.close()
            raise
        previous = self.engines.pop(request.engine, None)
        if previous is not None:
            previous.copier.close()
        self.engines[request.engine] = _Engine(copier, layout)

    def _queue(self, request: wire.Copy) -> torch.cuda.Event | None:
        engine = self.engines.get(request.engine)
        if engine is None:
            raise ServerError(f"engine #{request.engine} is not open in this copy process")
        if not 0 <= request.group < len(engine.layout.groups):
            raise InvalidRequest(f"KV cache group {request.group} does not exist")
        layout = engine.layout.groups[request.group]
        ids = np.frombuffer(request.block_ids, dtype=np.int64)
        plan = CopyPlan(layout, ids, request.blocks_per_chunk, request.first_slot)
        size = request.chunk_bytes
        offsets = np.frombuffer(request.chunk_offsets, dtype=np.int64).tolist()
        if any(o < 0 or o + size > len(self.pool) for o in offsets):
            raise ServerError("a chunk lies outside the shared pool")
        chunks = [self.pool[o:o + size] for o in offsets]
        return engine.copier.queue(plan, chunks, request.event_handle or None,
                                   request.to_host)


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


def _wait_and_reply(channel: socket.socket, done: torch.cuda.Event) -> None:
    try:
        done.synchronize()
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
