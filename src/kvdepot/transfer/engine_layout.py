"""An engine's whole KV cache as one chunk format, over its KV cache groups.

vLLM's hybrid KV cache manager splits a model's layers into groups (full attention, each
sliding window) that number their blocks independently: a block id names a block of
every layer of one group. A chunk then holds, for each group in order, that group's
blocks of the chunk's tokens, in the group's own `KVLayout` order. An engine with one
group (every model without sliding-window layers) has exactly the chunks it had before
groups existed, and the same fingerprint.

A recurrent group (Mamba, Gated DeltaNet: `LayerSpec.state`) is no part of a chunk: each
of its blocks holds the state after the tokens up to that block's end, one value for
everything before it. A state is kept as a piece of its own beside the chunk it ends
(`keys.state_key`), of `state_bytes`: one block of every state group.
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
        """Every group, by number (a copy names its group by number)."""
        state_numbers = set()
        for number in numbers:
            kinds = {s.state for s in layers if s.group == number}
            if len(kinds) > 1:
                raise InvalidRequest(f"KV cache group {number} mixes recurrent-state layers "
                                     "with attention layers; a group is one or the other")
            if kinds == {True}:
                state_numbers.add(number)
        self.token_groups = [g for g in self.groups if g.group not in state_numbers]
        """The groups whose blocks hold KV of their tokens: what a chunk holds."""
        self.state_groups = [g for g in self.groups if g.group in state_numbers]
        """Recurrent groups: a state (one block of each) is kept beside its chunk."""
        if not self.token_groups:
            raise InvalidRequest("only recurrent-state layers were registered: a state is "
                                 "kept with the attention KV of the tokens before it, so "
                                 "the model's attention layers must be registered with them")
        self.block_size = block_size
        self.num_blocks = min(g.num_blocks for g in self.groups)
        self.block_bytes = sum(g.block_bytes for g in self.token_groups)
        """One block of every attention group: a chunk is blocks-per-chunk times this."""
        self.state_bytes = sum(g.block_bytes for g in self.state_groups)
        """One recurrent state of the engine: a block of every state group (0: none)."""
        if len(self.groups) == 1:
            self.fingerprint = self.groups[0].fingerprint
        else:
            self.fingerprint = blake3(b"groups" + b"".join(
                (b"state" if g in self.state_groups else b"") + g.fingerprint
                for g in self.groups)).digest()[:16]

    def group_offsets(self, blocks_per_chunk: int) -> list[int]:
        """Where each attention group's bytes start in a chunk (`token_groups` order)."""
        offsets, at = [], 0
        for group in self.token_groups:
            offsets.append(at)
            at += blocks_per_chunk * group.block_bytes
        return offsets

    def state_blocks(self, lists: list[np.ndarray], with_state: bool) -> list[np.ndarray]:
        """Each state group's block holding the state a transfer carries (its list, which
        is that one block with a state and empty without), validated; none without."""
        if len(lists) != len(self.groups):
            raise InvalidRequest(f"this engine registered {len(self.groups)} KV cache groups, "
                                 f"but {len(lists)} block lists were given")
        if with_state and not self.state_groups:
            raise InvalidRequest("a recurrent state was named, but this engine registered "
                                 "no recurrent-state layers")
        out = []
        for group in self.state_groups:
            ids = lists[group.group]
            if len(ids) != (1 if with_state else 0):
                raise InvalidRequest(
                    f"KV cache group {group.group} holds recurrent states: its block list "
                    + ("must be the one block holding the state" if with_state else
                       "must be empty when no state is carried") + f", not {len(ids)} ids")
            group.validate_blocks(ids)
            out.append(ids)
        return out

    def group_blocks(self, lists: list[np.ndarray], needed: int, unheld_allowed: bool
                     ) -> list[tuple[np.ndarray, int]]:
        """Each attention group's first `needed` block ids (`token_groups` order),
        validated, with how many of them lead as `NO_BLOCK` (blocks the engine does not
        hold, allowed in retrieves only: a sliding window's blocks before the window)."""
        if len(lists) != len(self.groups):
            raise InvalidRequest(f"this engine registered {len(self.groups)} KV cache groups, "
                                 f"but {len(lists)} block lists were given")
        out = []
        for group in self.token_groups:
            number, ids = group.group, lists[group.group]
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
