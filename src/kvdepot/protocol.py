"""The wire protocol: every message between engines and the server, in one module.

A request is two ZeroMQ frames, `header` and `payload`:
  header  = struct "<IH": call id (echoed back), request type
  payload = msgpack of the request type's struct (see `REQUESTS`)
A reply is two frames as well:
  header  = struct "<IB": call id, status (0 ok, otherwise an `ErrorKind`)
  payload = msgpack of the response type, or of `ErrorReply` when status != 0

Token ids and block ids travel as packed little-endian int32 arrays (`bytes`), not as
msgpack lists: a 32k-token prompt is 128 KiB on the wire and decodes without a Python
object per token.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, NamedTuple

import msgspec
import numpy as np

from kvdepot.errors import MalformedPayload
from kvdepot.native import pack_int32

REQUEST_HEADER = struct.Struct("<IH")
REPLY_HEADER = struct.Struct("<IB")
STATUS_OK = 0

TOKEN_DTYPE = np.dtype("<i4")


class RequestType(enum.IntEnum):
    GET_CHUNK_SIZE = 1
    PING = 2
    LOOKUP = 3
    QUERY_PREFETCH_STATUS = 4
    FREE_LOOKUP_LOCKS = 5
    END_SESSION = 6
    REPORT_BLOCK_ALLOCATION = 7
    REGISTER_KV_CACHE = 8
    UNREGISTER_KV_CACHE = 9
    STORE = 10
    RETRIEVE = 11
    CLEAR = 12
    STATS = 13


def pack_ints(values: Any) -> bytes:
    """Pack token or block ids (list, tuple, array or tensor) as little-endian int32."""
    if isinstance(values, bytes):
        return values
    if isinstance(values, list | tuple):
        # numpy and array convert a list of Python ints slower than struct does; the C
        # extension (kvdepot.native) takes a seventh of struct's time.
        return pack_int32(values)
    return np.asarray(values, dtype=TOKEN_DTYPE).tobytes()


def unpack_ints(data: bytes) -> np.ndarray:
    if len(data) % TOKEN_DTYPE.itemsize:
        raise MalformedPayload(f"a packed int32 array has {len(data)} bytes, not a multiple "
                               "of 4")
    return np.frombuffer(data, dtype=TOKEN_DTYPE)


class Message(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Base of every payload; encoded as a msgpack array for compactness."""


class Empty(Message):
    pass


class ErrorReply(Message):
    message: str


class Pong(Message):
    boot_id: str
    """Random per server process: a change tells a client the server restarted."""


class KeyScope(Message):
    """What a chunk key is scoped by, besides the KV rank."""

    model: str
    world_size: int
    cache_salt: str = ""


class Lookup(Message):
    request_id: str
    scope: KeyScope
    token_ids: bytes
    readers_per_key: int = 1
    """How many retrieves each (chunk, rank) key will see: TP size for MLA, else 1."""


class QueryPrefetchStatus(Message):
    """Asks for a lookup's hit count. LOOKUP's own reply already carries it when every
    chunk was found in CPU memory, so this is only needed while lower tiers are read."""

    request_id: str


class FreeLookupLocks(Message):
    request_id: str
    start: int
    end: int


class EndSession(Message):
    request_id: str


class BlockAllocation(Message):
    req_id: str
    new_block_ids: list[int]
    new_token_ids: list[int]


class ReportBlockAllocation(Message):
    engine_pid: int
    model: str
    records: list[BlockAllocation]


class SharedCPUMemory(Message, tag="cpu"):
    """A CPU allocation in (unlinked) POSIX shared memory, reachable through the engine's
    open file descriptor as /proc/<pid>/fd/<fd>."""

    pid: int
    fd: int
    nbytes: int


class CudaIPCMemory(Message, tag="cuda"):
    """A CUDA allocation exported with cudaIpcGetMemHandle (via torch's storage sharing)."""

    device_uuid: str
    handle: bytes
    """The cudaIpcMemHandle_t of the allocation's base block."""
    offset: int
    """Byte offset of the storage inside that block."""
    nbytes: int
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False


MemoryHandle = SharedCPUMemory | CudaIPCMemory


class LayerSpec(Message):
    """One layer's KV tensor: a strided view into one of the registered allocations."""

    name: str
    allocation: int
    """Index into `RegisterKVCache.allocations`."""
    dtype: str
    shape: list[int]
    strides: list[int]
    """In elements, as torch reports them."""
    storage_offset: int
    """In elements."""
    block_axis: int
    """Which dimension indexes the engine's KV blocks."""


class RegisterKVCache(Message):
    instance_id: int
    model: str
    world_size: int
    rank: int
    block_size: int
    allocations: list[MemoryHandle]
    layers: list[LayerSpec]
    engine_pid: int = 0
    """The worker's process id, so the server can release its memory if it dies (0: unknown)."""


class Registered(Message):
    num_blocks: int
    chunk_bytes: int


class UnregisterKVCache(Message):
    instance_id: int


class BlockTransfer(Message):
    """What a store and a retrieve both name: tokens [start, end) and the engine blocks
    holding them, in order; `token_ids` run from position 0 because keys chain."""

    instance_id: int
    request_id: str
    token_ids: bytes
    start: int
    end: int
    block_ids: bytes
    cache_salt: str = ""
    event_handle: bytes | None = None
    """The engine's interprocess CUDA event to wait on first (None for CPU engines)."""


class Store(BlockTransfer):
    pass


class StoreResult(Message):
    stored: int
    """Chunks newly written."""
    present: int
    """Chunks that were already held (nothing copied)."""
    skipped_full: int
    """Chunks not stored because every byte of memory was locked or being written."""


class Retrieve(BlockTransfer):
    skip_first_n_tokens: int = 0


class RetrieveResult(Message):
    retrieved: int
    event_handle: bytes | None = None
    """An interprocess CUDA event recorded after the copies (GPU engines only)."""


class Stats(Message):
    values: dict[str, float]


class Served(enum.Enum):
    """Where the server answers a request type."""

    INLINE = "inline"
    """On the control thread, at once: it must never wait on a copy, a disk or a lock."""
    TRANSFER = "transfer"
    """On a transfer thread: it copies KV bytes or maps memory, and may take a while."""


class RequestKind(NamedTuple):
    request: type[Message]
    response: Any
    served: Served


REQUESTS: dict[RequestType, RequestKind] = {
    RequestType.GET_CHUNK_SIZE: RequestKind(Empty, int, Served.INLINE),
    RequestType.PING: RequestKind(Empty, Pong, Served.INLINE),
    RequestType.LOOKUP: RequestKind(Lookup, int | None, Served.INLINE),
    RequestType.QUERY_PREFETCH_STATUS: RequestKind(QueryPrefetchStatus, int | None,
                                                   Served.INLINE),
    RequestType.FREE_LOOKUP_LOCKS: RequestKind(FreeLookupLocks, None, Served.INLINE),
    RequestType.END_SESSION: RequestKind(EndSession, None, Served.INLINE),
    RequestType.REPORT_BLOCK_ALLOCATION: RequestKind(ReportBlockAllocation, None, Served.INLINE),
    RequestType.REGISTER_KV_CACHE: RequestKind(RegisterKVCache, Registered, Served.TRANSFER),
    RequestType.UNREGISTER_KV_CACHE: RequestKind(UnregisterKVCache, None, Served.TRANSFER),
    RequestType.STORE: RequestKind(Store, StoreResult, Served.TRANSFER),
    RequestType.RETRIEVE: RequestKind(Retrieve, RetrieveResult, Served.TRANSFER),
    RequestType.CLEAR: RequestKind(Empty, int, Served.INLINE),
    RequestType.STATS: RequestKind(Empty, Stats, Served.INLINE),
}
"""Every request type: its payload struct, its response type, and where it is served."""

ENCODER = msgspec.msgpack.Encoder()
REQUEST_DECODERS = {t: msgspec.msgpack.Decoder(k.request) for t, k in REQUESTS.items()}
RESPONSE_DECODERS = {t: msgspec.msgpack.Decoder(k.response) for t, k in REQUESTS.items()}
ERROR_DECODER = msgspec.msgpack.Decoder(ErrorReply)
