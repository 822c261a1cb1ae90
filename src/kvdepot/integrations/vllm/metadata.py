"""What the scheduler-side connector tells the worker-side connector each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvdepot.client.engine_types import LoadStoreOp


@dataclass
class TransferSpec:
    """One store or retrieve of a token range of one request.

    `start` is chunk-aligned, and so is a store's `end` unless it ends in a tail;
    a retrieve may end one token before a chunk's or tail's end (vLLM computes the
    prompt's last token), and then names only the blocks holding tokens before
    `end` while `token_ids` still cover that whole chunk or tail. `block_ids[i]`
    holds the tokens of block `start // block_size + i`. For a retrieve, the first
    `skip_first_n_tokens` tokens of the range sit in blocks shared with vLLM's own
    prefix cache and must not be written.
    """

    request_id: str
    token_ids: list[int]
    block_ids: list[list[int]]
    """One list per KV cache group; in a load, `NO_BLOCK` for blocks vLLM does not hold
    (a sliding window's before the window), which are not written."""
    start: int
    end: int
    cache_salt: str = ""
    skip_first_n_tokens: int = 0
    block_hashes: bytes = b""
    """A store's vLLM block hashes of [start, end), concatenated, when the engine publishes
    KV events: the server then reports the chunks under them."""
    hash_block_size: int = 0
    tail_tokens: int = 0
    """The range ends in a tail of this many tokens (`LoadStoreOp.tail_tokens`)."""
    state_groups: tuple[int, ...] = ()
    """The transfer carries the recurrent state after `end`, in these groups' one block
    each (`LoadStoreOp.state_groups`)."""
    inline: bool = False
    """A retrieve vLLM loads synchronously: the request is in this step's batch, so the
    worker waits for it before the forward, and reports its failure as load errors of this
    step, never as a finished receive."""


def load_store_op(spec: TransferSpec) -> LoadStoreOp:
    """The worker client's operation for `spec`."""
    return LoadStoreOp(
        token_ids=spec.token_ids,
        block_ids=spec.block_ids,
        start=spec.start,
        end=spec.end,
        skip_first_n_tokens=spec.skip_first_n_tokens,
        block_hashes=spec.block_hashes,
        hash_block_size=spec.hash_block_size,
        tail_tokens=spec.tail_tokens,
        state_groups=spec.state_groups,
    )


@dataclass
class StagedLoad:
    """A load already copied into the worker's staging area (`staging.StagingArea`): the
    worker moves staging slots `first_slot`, `first_slot + 1`, ... into blocks `block_ids`
    on its own stream before the step's forward. Nothing outside the worker takes part any
    more, so it cannot fail; vLLM loads it synchronously."""

    request_id: str
    first_slot: int
    block_ids: list[int]


@dataclass
class KVDepotConnectorMetadata(KVConnectorMetadata):
    """The transfers of one engine step and the request events the worker must see.

    Plain dataclasses, because vLLM pickles the metadata into every worker.
    """

    loads: list[TransferSpec] = field(default_factory=list)
    """Retrieves to submit; every one has a token range (`start < end`)."""
    failed_loads: dict[str, list[int]] = field(default_factory=dict)
    """Loads the scheduler gave up on before any retrieve was sent (vLLM asked for other
    tokens than were offered), by request id: the blocks vLLM expects them to fill, every
    group's, vLLM's null blocks and blocks shared with its prefix cache left out. The
    worker reports exactly these blocks as load errors (the request, with several groups)
    and the request as finished receiving, so vLLM recomputes them."""
    staged: list[StagedLoad] = field(default_factory=list)
    """Staged loads of requests computed in this step, to move into their blocks first."""
    inline_failed_loads: list[str] = field(default_factory=list)
    """Those of `failed_loads` that were synchronous (`TransferSpec.inline`): the request
    is in this step's batch, so it is not reported as finished receiving."""
    wait_for_loads: bool = False
    """Nothing computes in this step and asynchronous loads are pending: the worker waits
    for them within it (up to the synchronous loads' limit) instead of leaving them to
    later steps' polls (`SchedulerSide.build_meta`). They stay asynchronous: reported,
    failed or not, as finished receiving."""
    stores: list[TransferSpec] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    """Requests preempted this step: their blocks were freed and may be handed
    to another request, so their in-flight stores must finish first."""
    delayed_free_req_ids: list[str] = field(default_factory=list)
    """Finished requests whose block release waits for their stores; only these
    may be reported in `finished_sending`."""
    reused_block_ids: list[int] = field(default_factory=list)
    """Blocks handed out this step, for engines with several KV cache groups only:
    vLLM frees a sliding window's blocks while the request runs, and may give them
    to another request at once, so a store still reading one must finish first."""

    def __len__(self) -> int:
        # A step whose only news is a failed load is not empty.
        return len(self.loads) + len(self.staged) + len(self.failed_loads) + len(self.stores)
