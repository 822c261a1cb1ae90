"""An engine copy that has been queued and may still be running.

A CUDA copy is queued on the GPU's streams and finishes later: the thread that queued it
goes on to the next operation, and whoever completes the operation waits for it (see
`kvdepot.server.completions`). A CPU copy runs while it is queued, so it is finished
when handed back.
"""

from __future__ import annotations

from typing import Protocol


class QueuedCopy(Protocol):
    finished: bool
    """True when the copy is known to be over already (`wait` then returns at once)."""

    def wait(self) -> None:
        """Return once the copy is over; raise if it failed."""


class _Finished:
    finished = True

    def wait(self) -> None:
        return None


FINISHED: QueuedCopy = _Finished()
"""A copy that ran to its end while it was queued."""
