"""The chunks and tails this engine's stores have already named to the server.

A prompt vLLM serves from its own prefix cache was computed (or loaded) by this engine
before, and stored then. Sending it again costs the engine a store on the hit's step
and the server a key derivation, for chunks the server answers it holds already. The
scheduler side skips the pieces named here instead.

A piece is named by vLLM's hash of the block it ends in, which chains every token before
it and the request's key scope (cache salt, LoRA adapter, multimodal inputs), so two
requests share a name only where they share the KV. What the server answers corrects
the record: a lookup that finds less than was named drops the rest (the server lost or
evicted them, so the next computation stores them again), and a new server process
starts it afresh. A piece wrongly taken for offered is only a later miss, never a
wrong byte.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

CAPACITY = 1 << 16
"""Names kept, the oldest forgotten first: a forgotten piece is only stored once more."""


class OfferedChunks:
    """A bounded record of piece names, reset whenever the server's boot id changes."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._capacity = capacity
        self._names: OrderedDict[Hashable, None] = OrderedDict()
        self._boot_id: str | None = None

    def of_server(self, boot_id: str) -> OfferedChunks:
        """This record, emptied first if `boot_id` is not the server it was kept for."""
        if boot_id != self._boot_id:
            self._names.clear()
            self._boot_id = boot_id
        return self

    def __contains__(self, name: Hashable) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def add(self, names: Iterable[Hashable]) -> None:
        for name in names:
            self._names[name] = None
            self._names.move_to_end(name)
        while len(self._names) > self._capacity:
            self._names.popitem(last=False)

    def discard(self, names: Iterable[Hashable]) -> None:
        for name in names:
            self._names.pop(name, None)
