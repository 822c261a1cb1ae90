"""An engine's whole KV cache as one chunk format, over its KV cache groups.

vLLM's hybrid KV cache manager splits a model's layers into groups (full attention, each
sliding window) that number their blocks independently: a block id names a block of
every layer of one group. A chunk then holds, for each group in order, that group's
blocks of the chunk's tokens, in the group's own `KVLayout` order. An engine with one
group (every model without sliding-window layers) has exactly the chunks it had before
groups existed, and the same fingerprint.
"""

from __future__ import annotations

import numpy as np
from blake3 import blake3

from kvdepot.errors import InvalidRequest
from kvdepot.protocol import NO_BLOCK, LayerSpec
from kvdepot.transfer.layout import KVLayout


class EngineLayout:
    """The registered KV cache of one engine worker: one `KVLayout` per group."""

    def __init__(self, layers: list[LayerSpec], allocation_bytes: list[int], block_size: int
                 ) -> None:
        numbers = sorted({spec.group for spec in layers})
        if numbers != list(range(len(numbers))):
            raise InvalidRequest(f"KV cache groups must be numbered 0, 1, ... without gaps; "
                                 f"the layers name groups {numbers}")
        self.groups = [KVLayout([s for s in layers if s.group == g], allocation_bytes,
                                block_size, group=g) for g in numbers]
        self.block_size = block_size
        self.num_blocks = min(g.num_blocks for g in self.groups)
        self.block_bytes = sum(g.block_bytes for g in self.groups)
        """One block of every group: a chunk is blocks-per-chunk times this."""
        if len(self.groups) == 1:
            self.fingerprint = self.groups[0].fingerprint
        else:
            self.fingerprint = blake3(b"groups" + b"".join(
                g.fingerprint for g in self.groups)).digest()[:16]

    def group_offsets(self, blocks_per_chunk: int) -> list[int]:
        """Where each group's bytes start in a chunk."""
        offsets, at = [], 0
        for group in self.groups:
            offsets.append(at)
            at += blocks_per_chunk * group.block_bytes
        return offsets

    def group_blocks(self, lists: list[np.ndarray], needed: int, unheld_allowed: bool
                     ) -> list[tuple[np.ndarray, int]]:
        """Each group's first `needed` block ids, validated, with how many of them lead as
        `NO_BLOCK` (blocks the engine does not hold, allowed in retrieves only: a sliding
        window's blocks before the window)."""
        if len(lists) != len(self.groups):
            raise InvalidRequest(f"this engine registered {len(self.groups)} KV cache groups, "
                                 f"but {len(lists)} block lists were given")
        out = []
        for number, (group, ids) in enumerate(zip(self.groups, lists, strict=True)):
            which = f" of KV cache group {number}" if len(self.groups) > 1 else ""
            if len(ids) < needed:
                raise InvalidRequest(f"the range spans {needed} blocks of {self.block_size} "
                                     f"tokens but only {len(ids)} block ids{which} were given")
            ids = ids[:needed]
            held = np.flatnonzero(ids != NO_BLOCK)
            unheld = int(held[0]) if len(held) else len(ids)
            if unheld and not unheld_allowed:
                raise InvalidRequest(f"block id {NO_BLOCK} (a block the engine does not hold) "
                                     f"in a store{which}: a chunk is stored whole or not at all")
            if (ids[unheld:] == NO_BLOCK).any():
                raise InvalidRequest(f"block id {NO_BLOCK}{which} may only lead a block list "
                                     "(a sliding window's blocks before the window)")
            group.validate_blocks(ids[unheld:])
            out.append((ids, unheld))
        return out
