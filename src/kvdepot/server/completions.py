"""Stores and retrieves whose copies are still running when their handler returns.

A handler queues an operation's CUDA copies and hands back a `Deferred`: the copies and
what to do once they are over (write the fence, commit or unpin the chunks, build the
reply). A `Completer` thread waits for them in the order they came and finishes each, so
the transfer threads go straight on to the next operation: the GPU holds every
operation the engines have in flight, not one per transfer thread, and no more threads
contend for the interpreter than there is work for (docs/benchmarks.md shows both limits).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdepot.transfer.queued_copy import QueuedCopy

log = logging.getLogger(__name__)


@dataclass
class Deferred:
    copies: list[QueuedCopy]
    finish: Callable[[BaseException | None], Any]
    """Called once every copy is over, with the first error one raised (None if none);
    returns the reply, or raises."""

    def complete(self) -> Any:
        """Wait for every copy (all of them, even after one failed: nothing may still run
        when the chunks are given up), then finish."""
        error: BaseException | None = None
        for copy in self.copies:
            try:
                copy.wait()
            except BaseException as exc:  # a CUDA error, reported as the operation's
                error = error or exc
        return self.finish(error)


class Completer:
    """One thread finishing deferred operations in the order they were added."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Deferred, Callable[[Any], None]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def add(self, deferred: Deferred, settle: Callable[[Any], None]) -> None:
        """`settle` gets the reply, or the exception that replaces it."""
        self._queue.put((deferred, settle))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            deferred, settle = item
            try:
                outcome = deferred.complete()
            except Exception as exc:
                outcome = exc
            try:
                settle(outcome)
            except Exception:
                log.exception("settling a finished operation failed")

    def close(self) -> None:
        """Finish everything added so far, then stop."""
        self._queue.put(None)
        self._thread.join()
