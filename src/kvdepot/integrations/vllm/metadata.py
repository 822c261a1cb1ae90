"""What the scheduler-side connector tells the worker-side connector each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class TransferSpec:
    """One store or retrieve of a chunk-aligned token range of one request.

    `block_ids[i]` holds the tokens of block `start // block_size + i`. For a
    retrieve, the first `skip_first_n_tokens` tokens of the range sit in blocks
    shared with vLLM's own prefix cache and must not be written.
    """

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int
    cache_salt: str = ""
    skip_first_n_tokens: int = 0


@dataclass
class KVDepotConnectorMetadata(KVConnectorMetadata):
    """The transfers of one engine step and the request events the worker must see.

    Plain dataclasses, because vLLM pickles the metadata into every worker.
    """

    loads: list[TransferSpec] = field(default_factory=list)
    stores: list[TransferSpec] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    """Requests preempted this step: their blocks were freed and may be handed
    to another request, so their in-flight stores must finish first."""
    delayed_free_req_ids: list[str] = field(default_factory=list)
    """Finished requests whose block release waits for their stores; only these
    may be reported in `finished_sending`."""

    def __len__(self) -> int:
        return len(self.loads) + len(self.stores)
