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

Every variable-length field and every count carries a bound (`Meta`), so decoding a
message is itself bounded: msgspec checks a string's or array's length from its header,
before it decodes the elements. The bounds and their reasons are the named constants
below (documented in the README); a message past one gets a MalformedPayload reply.
"""

from __future__ import annotations

import enum
import os
import re
import struct
import typing
from typing import Annotated, Any, NamedTuple

import msgspec
import numpy as np
from msgspec import Meta

from kvdepot.errors import MalformedPayload
from kvdepot.native import pack_int32

REQUEST_HEADER = struct.Struct("<IH")
REPLY_HEADER = struct.Struct("<IB")
STATUS_OK = 0

TOKEN_DTYPE = np.dtype("<i4")

# ---- bounds (each is a limit a legitimate engine stays far below) ------------------------
MAX_TOKENS = 1 << 22
"""Tokens (and block ids) in one message: 4M tokens, four times the longest contexts
served today, 16 MiB packed."""
MAX_MESSAGE_BYTES = 2 * MAX_TOKENS * TOKEN_DTYPE.itemsize + (1 << 20)
"""The server socket's ZMQ_MAXMSGSIZE: a store or retrieve of MAX_TOKENS tokens with as
many block ids, plus room for the rest. ZeroMQ checks it per frame, from the frame's
size field: a peer sending a larger frame is disconnected before it is read."""
MAX_ID_CHARS = 1024
"""Request ids: vLLM's are under 100 characters (a prefix, a UUID, a suffix); a lookup
job keeps its id for up to the lock TTL."""
MAX_NAME_CHARS = 1024
"""Model names (Hugging Face ids or local paths), layer names, dtype and device names."""
MAX_SALT_CHARS = 512
"""cache_salt (keys.validate_cache_salt also requires printable characters)."""
MAX_WORLD_SIZE = 1 << 16
"""KV ranks (a rank is a 2-byte suffix of a chunk key)."""
MAX_READERS = 1024
"""readers_per_key: the TP size of an MLA engine."""
MAX_ALLOCATIONS = 4096
"""Memory allocations in one registration (one per layer at most, in older vLLM)."""
MAX_LAYERS = 4096
"""Layer names in one registration."""
MAX_DIMS = 8
"""Dimensions of one layer's KV tensor (vLLM's have 3 to 6)."""
MAX_GROUPS = 64
"""KV cache groups of one registration: vLLM's hybrid KV cache manager makes one per
attention kind and window (full attention, each sliding window), a handful in practice."""
MAX_EXTENT = 1 << 48
"""Any size, stride or offset in elements or bytes: the x86-64 address space."""
MAX_HANDLE_BYTES = 256
"""A CUDA IPC handle (memory, event or reference counter): 64 bytes in CUDA 12."""
MAX_BLOCK_REPORT_RECORDS = 1024
"""Records in one REPORT_BLOCK_ALLOCATION (the requests of one scheduler step)."""
MAX_BLOCK_REPORT_BYTES = 1 << 20
"""The whole payload of a REPORT_BLOCK_ALLOCATION. It is decoded on the control loop,
so it is bounded to keep its decoding far below a millisecond; a client splits larger
reports (they are telemetry and may be dropped)."""

MAX_BLOCK_HASH_BYTES = 32
"""One vLLM block hash (sha256: 32 bytes), as a store sends them for block events."""
MAX_BLOCK_EVENTS_REPLY = 1024
"""Block events in one TAKE_BLOCK_EVENTS reply (answered on the control thread: 1,024 events
of 16 hashes take about 0.4 ms to gather and encode); a poller further behind asks again."""

NO_BLOCK = -1
"""In a retrieve's block list: a block the engine does not hold, not written."""

MAX_PREFILL_RATE = 1e9
"""Tokens per second, far past any engine: bounds a rate so that no float, infinity
included, turns the load-or-compute decision into nonsense."""
RequestId = Annotated[str, Meta(max_length=MAX_ID_CHARS)]
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
Salt = Annotated[str, Meta(max_length=MAX_SALT_CHARS)]
PackedInts = Annotated[memoryview, Meta(max_length=MAX_TOKENS * TOKEN_DTYPE.itemsize)]
"""Token or block ids as little-endian int32 (clients may pass bytes). Decoded as a view
into the received message, not a copy: a store's 32 MiB of ids cost the server's
control loop microseconds instead of 14 ms holding the GIL (issue 27)."""
Count = Annotated[int, Meta(ge=0, le=MAX_EXTENT)]
TokenIndex = Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
InstanceId = Annotated[bytes, Meta(max_length=32)]
"""Registration ids and handover tickets: 16 random bytes the server made."""
WorldSize = Annotated[int, Meta(ge=1, le=MAX_WORLD_SIZE)]
Rank = Annotated[int, Meta(ge=0, le=MAX_WORLD_SIZE - 1)]
Handle = Annotated[bytes, Meta(max_length=MAX_HANDLE_BYTES)]


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
    TAKE_BLOCK_EVENTS = 14


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
    handover: str = ""
    """The Unix socket address workers hand their shared-memory files to (see
    `HandoverRequest`)."""
    pid: int = 0
    uid: int = -1
    """The server process's pid and uid. They arrive over the authenticated connection,
    so a worker hands its memory only to a handover socket whose peer (SO_PEERCRED) is
    this process: an abstract name is visible to everyone, and a dead server's can be
    bound by anyone."""
    handover_path: str = ""
    """The handover socket's name in the server's socket directory (`--socket-dir`), for
    engines of other network namespaces, which know where they mounted the directory;
    "" without one."""
    ipc_namespace: int = 0
    """The server's IPC namespace (`ipc_namespace_id`; 0: not said). A CUDA event's
    interprocess handle opens only in the IPC and PID namespaces it was made in, so a
    worker of another one waits for its events itself and sends none."""



def ipc_namespace_id() -> int:
    """This process's IPC namespace: the inode of /proc/self/ns/ipc, 0 where unreadable."""
    try:
        return os.stat("/proc/self/ns/ipc").st_ino
    except OSError:
        return 0

class KeyScope(Message):
    """What a chunk key is scoped by, besides the KV rank."""

    model: Name
    world_size: WorldSize
    cache_salt: Salt = ""


class Lookup(Message):
    request_id: RequestId
    scope: KeyScope
    token_ids: PackedInts
    readers_per_key: Annotated[int, Meta(ge=1, le=MAX_READERS)] = 1
    """How many retrieves each (chunk, rank) key will see: TP size for MLA, else 1."""
    prefill_tokens_per_s: Annotated[float, Meta(gt=0, le=MAX_PREFILL_RATE)] | None = None
    """How fast the asking engine computes a prompt, measured from its own steps: lower
    tiers are then read only as far as loading beats computing. None: load every chunk
    held."""
    block_hashes: bytes = b""
    """vLLM's hashes of the blocks of the prompt's whole chunks from chunk
    `hashes_first_chunk` on, as in a store: chunks promoted from a lower tier for this
    lookup, such as the shared tier's, are then reported under them (TAKE_BLOCK_EVENTS).
    The engine leaves out the leading chunks it knows are in CPU memory already."""
    hash_block_size: TokenIndex = 0
    hashes_first_chunk: Annotated[int, Meta(ge=0, le=MAX_TOKENS)] = 0
    hashes_parent: Annotated[bytes, Meta(max_length=MAX_BLOCK_HASH_BYTES)] = b""
    """The hash of the block before the first one sent (empty at the prompt's start)."""
    tails: bool = False
    """The engine loads tails (`Store.tail_tokens`): the hit may then end in the longest
    held tail after its whole chunks, and this lookup's reply (and
    QUERY_PREFETCH_STATUS's) counts hit tokens instead of chunks. False: whole chunks
    only, counted in chunks."""
    states: bool = False
    """The engine has recurrent layers (`LayerSpec.state`): the hit then ends at the last
    chunk of the held prefix whose end state is held too (`Store.with_state`), and that
    state is locked with the chunks. CPU memory only: the lower tiers are not read."""


class QueryPrefetchStatus(Message):
    """Asks for a lookup's hit count. LOOKUP's own reply already carries it when every
    chunk was found in CPU memory, so this is only needed while lower tiers are read."""

    request_id: RequestId


class FreeLookupLocks(Message):
    request_id: RequestId
    start: Count
    end: Count


class EndSession(Message):
    request_id: RequestId


class BlockAllocation(Message):
    req_id: RequestId
    new_block_ids: PackedInts
    new_token_ids: PackedInts


class ReportBlockAllocation(Message):
    engine_pid: Count
    model: Name
    records: Annotated[list[BlockAllocation], Meta(max_length=MAX_BLOCK_REPORT_RECORDS)]


class SharedCPUMemory(Message, tag="cpu"):
    """A CPU allocation in (unlinked) shared memory, whose file descriptor the worker
    handed to the server over the handover socket: `fd_index` is its position among the
    descriptors of the registration's `handover_ticket`."""

    fd_index: Annotated[int, Meta(ge=0, le=MAX_ALLOCATIONS)]
    nbytes: Count


class CudaIPCMemory(Message, tag="cuda"):
    """A CUDA allocation exported with cudaIpcGetMemHandle (via torch's storage sharing)."""

    device_uuid: Name
    handle: Handle
    """The cudaIpcMemHandle_t of the allocation's base block."""
    offset: Count
    """Byte offset of the storage inside that block."""
    nbytes: Count
    ref_counter_handle: Handle = b""
    ref_counter_offset: Count = 0
    event_handle: Handle = b""
    event_sync_required: bool = False


class CudaVMMMemory(Message, tag="cuda-vmm"):
    """CUDA memory the driver maps (cuMemCreate: vLLM 0.34's extensible KV cache), which
    cudaIpcGetMemHandle cannot export: the physical allocation under the storage exported
    as a POSIX file descriptor (cuMemExportToShareableHandle), handed to the server over
    the handover socket like a CPU allocation's. One allocation per storage."""

    device_uuid: Name
    fd_index: Annotated[int, Meta(ge=0, le=MAX_ALLOCATIONS)]
    """The descriptor's position among the registration's handed-over descriptors."""
    allocation_bytes: Count
    """The physical allocation's size: the server maps exactly this much of it."""
    offset: Count
    """Byte offset of the storage inside the allocation."""
    nbytes: Count
    """Bytes the storage spans (offset + nbytes <= allocation_bytes)."""


MemoryHandle = SharedCPUMemory | CudaIPCMemory | CudaVMMMemory


class LayerSpec(Message):
    """One layer's KV tensor: a strided view into one of the registered allocations."""

    name: Name
    allocation: Annotated[int, Meta(ge=0, lt=MAX_ALLOCATIONS)]
    """Index into `RegisterKVCache.allocations`."""
    dtype: Name
    shape: Annotated[list[Count], Meta(max_length=MAX_DIMS)]
    strides: Annotated[list[Count], Meta(max_length=MAX_DIMS)]
    """In elements, as torch reports them."""
    storage_offset: Count
    """In elements."""
    block_axis: Annotated[int, Meta(ge=0, lt=MAX_DIMS)]
    """Which dimension indexes the engine's KV blocks."""
    group: Annotated[int, Meta(ge=0, lt=MAX_GROUPS)] = 0
    """The KV cache group the layer belongs to. Groups number blocks independently (a
    block id names a block of each layer of its group), so a store or retrieve names one
    block list per group; a chunk holds every group's blocks of its tokens."""
    state: bool = False
    """The layer is recurrent (Mamba, Gated DeltaNet): each of its blocks holds one state,
    the one after the tokens up to that block's end, not KV of the block's tokens. Every
    layer of its group must say so. A chunk never holds such a group's blocks: a state
    is kept beside the chunk it ends (`Store.with_state`)."""


class RegisterKVCache(Message):
    model: Name
    world_size: WorldSize
    rank: Rank
    block_size: Annotated[int, Meta(ge=1, le=MAX_TOKENS)]
    allocations: Annotated[list[MemoryHandle], Meta(max_length=MAX_ALLOCATIONS)]
    layers: Annotated[list[LayerSpec], Meta(max_length=MAX_LAYERS)]
    engine_pid: Count = 0
    """The pid the handover reply carried (`HandoverReply.pid`): the worker's pid in the
    server's PID namespace, 0 in another one."""
    handover_ticket: InstanceId = b""
    """What the handover socket returned for this registration's file descriptors."""
    replaces: InstanceId = b""
    """The instance id of this worker's previous registration (after a reconnection),
    which the server then drops."""
    fence: SharedCPUMemory | None = None
    """The worker's fence file (`kvdepot.transfer.fence`), handed over with the KV memory;
    a registration without one is refused."""


class Registered(Message):
    instance_id: bytes
    """Generated by the server; valid only on the connection that registered."""
    num_blocks: int
    chunk_bytes: int


class UnregisterKVCache(Message):
    instance_id: InstanceId


class BlockTransfer(Message):
    """What a store and a retrieve both name: tokens [start, end) and the engine blocks
    holding them, in order; `token_ids` run from position 0 because keys chain. `start` is
    chunk-aligned; so is a store's `end`, unless it ends in a tail. A retrieve's `end` may
    fall inside a chunk or tail (the engine loads all but the prompt's last token):
    `token_ids` then still cover that whole chunk or tail (its key), and only the blocks
    holding tokens before `end` are named and written."""

    instance_id: InstanceId
    request_id: RequestId
    token_ids: PackedInts
    start: TokenIndex
    end: TokenIndex
    block_ids: PackedInts
    cache_salt: Salt = ""
    event_handle: Handle | None = None
    """The engine's interprocess CUDA event to wait on first (None for CPU engines)."""
    fence_slot: Annotated[int, Meta(ge=-1, le=MAX_EXTENT)] = -1
    fence_generation: Annotated[int, Meta(ge=0, lt=1 << 56)] = 0
    """The operation's slot in the registration's fence and the generation the worker armed
    it with; the server copies only while the slot still says (generation, PENDING)."""
    group_block_ids: Annotated[list[PackedInts], Meta(max_length=MAX_GROUPS - 1)] = []
    """The block lists of KV cache groups 1, 2, ... (`block_ids` is group 0's), one per
    further group the engine registered, each laid out like `block_ids`. In a retrieve a
    group's list may start with `NO_BLOCK` entries: blocks the engine does not hold
    (outside a sliding window), which are not written."""


class Store(BlockTransfer):
    block_hashes: bytes = b""
    """vLLM's hashes of the blocks of [start, end), in order, all of one length (at most
    `MAX_BLOCK_HASH_BYTES`), a block being `hash_block_size` tokens: the server reports
    the stored chunks under these hashes (TAKE_BLOCK_EVENTS). Empty: none are reported."""
    hash_block_size: TokenIndex = 0
    tail_tokens: TokenIndex = 0  # last, so earlier fields keep their places on the wire
    """The range's last piece is a tail of this many tokens (fewer than a chunk) after its
    last whole chunk, keyed on its own (`keys.tail_key`) and held in the blocks holding
    them (the last one partly: its slots past the tail are never loaded as KV, the engine
    computes them): a store's `end` is the tail's end, a retrieve's lies inside it, and
    `token_ids` cover it. Only for engines with one KV cache group. 0: every piece is a
    whole chunk."""
    with_state: bool = False
    """The range ends at a chunk boundary and carries the recurrent state after it
    (`keys.state_key` of its last chunk): each state group's block list is then that one
    block, and empty without a state. Only for engines with state groups."""


class BlockEvent(Message):
    """Blocks of one chunk that entered (`stored`) or left a tier of the server, named by
    the vLLM block hashes sent with their store (vLLM's `BlockStored` and `BlockRemoved`)."""

    stored: bool
    medium: str
    """"CPU" or "DISK"."""
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    """The hash of the block before the first one; None at a prompt's start."""
    block_size: int


class TakeBlockEvents(Message):
    """Block events of the caller's tenant after sequence number `after` (-1: from the
    oldest the server still keeps)."""

    after: Annotated[int, Meta(ge=-1, le=1 << 62)] = -1


class BlockEvents(Message):
    events: list[BlockEvent]
    last: int
    """The sequence number of the last event returned (`after` when none): the next
    call's `after`."""
    dropped: int
    """Events after `after` the server no longer keeps (its bounded log wrapped)."""


class StoreResult(Message):
    stored: int
    """Chunks newly written."""
    present: int
    """Chunks that were already held (nothing copied)."""
    skipped_full: int
    """Chunks not stored because every byte of memory was locked or being written."""


class Retrieve(BlockTransfer):
    skip_first_n_tokens: TokenIndex = 0
    tail_tokens: TokenIndex = 0
    """As in `Store`."""
    with_state: bool = False
    """As in `Store`: the recurrent state after `end` is written to the state groups'
    one block each."""


class RetrieveResult(Message):
    retrieved: int
    """Chunks (and tails) copied; the blocks are written when this reply is sent."""


class Stats(Message):
    values: dict[str, float]


class HandoverRequest(Message):
    """Sent over the handover socket (a Unix SOCK_SEQPACKET socket, not ZeroMQ) with the
    worker's shared-memory file descriptors attached (SCM_RIGHTS)."""

    name: str
    """The worker's credential name (empty when the server runs --insecure)."""
    token: str


class HandoverReply(Message):
    ticket: bytes = b""
    """Names the descriptors in a REGISTER_KV_CACHE, once, for a short time."""
    error: str = ""
    pid: int = 0
    """The pid the REGISTER_KV_CACHE must claim: the sender's pid in the server's PID
    namespace, as the kernel reported it; 0 for a sender of another PID namespace."""


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
    RequestType.TAKE_BLOCK_EVENTS: RequestKind(TakeBlockEvents, BlockEvents, Served.INLINE),
}
"""Every request type: its payload struct, its response type, and where it is served."""


def describe_validation_error(request: type[Message], error: msgspec.ValidationError) -> str:
    """msgspec's message with its path of array indices (`$[1][2]`, since messages are
    msgpack arrays) spelled as field names (`scope.cache_salt`), as far as they resolve."""
    text = str(error)
    message, sep, path = text.rpartition(" - at `$")
    if not sep:
        return text
    names: list[str] = []
    current: Any = request
    for index in re.findall(r"\[(\d+)\]", path):
        while typing.get_origin(current) is Annotated:
            current = typing.get_args(current)[0]
        if isinstance(current, type) and issubclass(current, msgspec.Struct):
            fields = msgspec.structs.fields(current)
            if int(index) >= len(fields):
                break
            names.append(fields[int(index)].name)
            current = fields[int(index)].type
        elif typing.get_origin(current) is list:
            names[-1:] = [f"{names[-1] if names else ''}[{index}]"]
            current = typing.get_args(current)[0]
        else:
            break
    return f"{'.'.join(names)}: {message}" if names else text


MAX_PAYLOAD_BYTES: dict[RequestType, int] = {
    RequestType.REPORT_BLOCK_ALLOCATION: MAX_BLOCK_REPORT_BYTES,
}
"""Request types whose payload is bounded below MAX_MESSAGE_BYTES, checked before decoding."""

ENCODER = msgspec.msgpack.Encoder()
REQUEST_DECODERS = {t: msgspec.msgpack.Decoder(k.request) for t, k in REQUESTS.items()}
RESPONSE_DECODERS = {t: msgspec.msgpack.Decoder(k.response) for t, k in REQUESTS.items()}
ERROR_DECODER = msgspec.msgpack.Decoder(ErrorReply)
