"""The plain data types engines hand the clients (the seed's public names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelStrategy:
    use_mla: bool
    """MLA models keep one KV copy per pipeline stage, shared by every TP rank."""
    kv_world_size: int
    """Ranks that store distinct KV (TP x PP, or PP alone for MLA)."""
    kv_worker_id: int
    """This worker's rank among those."""
    actual_world_size: int
    actual_worker_id: int
    tp_size: int
    pp_size: int

    @property
    def readers_per_key(self) -> int:
        """How many workers retrieve each stored key: all TP ranks for MLA, else one."""
        return self.tp_size if self.use_mla else 1

    @classmethod
    def simple(cls, world_size: int, kv_rank: int, tp_size: int) -> ParallelStrategy:
        return cls(use_mla=False, kv_world_size=world_size, kv_worker_id=kv_rank,
                   actual_world_size=world_size, actual_worker_id=kv_rank, tp_size=tp_size,
                   pp_size=1)


@dataclass
class LoadStoreOp:
    token_ids: list[int]
    """The request's tokens from position 0 (keys chain over the whole prefix)."""
    block_ids: list[int] | list[list[int]]
    """Engine block ids holding tokens [start, end), in order: one list, or one list per
    KV cache group (vLLM's hybrid KV cache manager; groups number blocks independently).
    A retrieve's group list may start with `NO_BLOCK` (-1): blocks the engine does not
    hold (before a sliding window), which are not written."""
    start: int = 0
    """Chunk-aligned."""
    end: int = 0
    """Chunk-aligned for a store without a tail; a retrieve may end inside a chunk or tail
    (its blocks holding tokens before `end` are written; `token_ids` must still cover the
    whole chunk or tail)."""
    skip_first_n_tokens: int = 0
    """Leading tokens of the range a retrieve must not write (shared prefix-cache blocks)."""
    block_hashes: bytes = b""
    """A store's vLLM block hashes of [start, end), concatenated (see `Store.block_hashes`),
    so the server reports the chunks in vLLM's KV events; empty for none."""
    hash_block_size: int = 0
    """Tokens per hashed block."""
    tail_tokens: int = 0
    """The range ends in a tail of this many tokens (past its last whole chunk, held in
    the blocks holding them; see `Store.tail_tokens`): `end` is the tail's end (a
    retrieve's may lie inside it), and `token_ids` must cover the tail. 0: whole chunks
    only."""
    state_groups: tuple[int, ...] = ()
    """The recurrent-state groups, when the op carries the state after `end` (see
    `Store.with_state`): each one's list is then the one block holding that state. Empty
    when it carries none (a state group's list is then empty)."""

    def group_block_ids(self) -> list[list[int]]:
        """The block ids as one list per KV cache group."""
        ids = self.block_ids
        # len(), not truth: engines and benchmarks pass numpy arrays and tensors too.
        if len(ids) and isinstance(ids[0], list | tuple):
            return [list(group) for group in ids]  # type: ignore[arg-type]
        return [list(ids)]  # type: ignore[arg-type]

    def __len__(self) -> int:
        """Blocks of the first group (every group spans the same tokens)."""
        return len(self.group_block_ids()[0]) if len(self.block_ids) else 0


@dataclass
class BlockAllocationRecord:
    req_id: str
    new_block_ids: list[int]
    new_token_ids: list[int]
