"""What crosses the copier boundary for one KV cache group of a store or retrieve.

A copier gets every group of an operation at once (`Copier.gather`/`scatter` take a
sequence of `GroupCopy`), so a GPU's copy process hears of an operation in one message.
The chunks' bytes are named as extents of the CPU pool, offset and length, the form the
tier hands them out in and the form a copy process (which maps the same pool at another
address) can use as it is; a copier that runs in the server takes its views of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvdepot.transfer.layout import CopyPlan


@dataclass(frozen=True)
class PoolExtents:
    """One group's part of each chunk of an operation, in chunk order."""

    pool: np.ndarray
    """The whole CPU pool, as flat bytes."""
    offsets: np.ndarray
    """int64: where each chunk's part starts in the pool."""
    length: int
    """Bytes of each chunk's part (the same for every chunk of one group)."""

    def views(self) -> list[np.ndarray]:
        """Each chunk's part as a view of the pool, for copiers in this process."""
        return [self.pool[at:at + self.length] for at in self.offsets.tolist()]


@dataclass(frozen=True)
class GroupCopy:
    """One KV cache group's copies of an operation (`plan.group` says which group) and
    the pool extents they read or write."""

    plan: CopyPlan
    extents: PoolExtents
