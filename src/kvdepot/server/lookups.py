"""Lookup jobs: which chunks a request was promised, and the read locks behind the promise.

A LOOKUP locks every chunk of the hit (on every rank) with as many reads as the request
will make. Each retrieve gives back the reads it made; FREE_LOOKUP_LOCKS gives back
chunks that will never be read; END_SESSION and the TTL give back whatever is left, so
a crashed or forgetful engine cannot pin memory forever.

The table bounds, per tenant (the tenant of the caller's credential; "" for every
credential without one), how many bytes of CPU memory the jobs' locks hold: a chunk
counts once per tenant however many of its jobs hold it, so a prefix that every request
shares costs its size once, and a tenant gains nothing by opening more connections. A
lookup past the byte bound locks a shorter prefix (the engine computes the rest). Open
jobs are bounded per connection (the scheduler client that sent them) and per tenant;
a lookup past either bound is refused (0 hits).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

from kvdepot.keys import ChunkKey
from kvdepot.storage.cpu_tier import CPUTier

EXPIRE_BATCH = 256
"""Jobs one expiry pass drops at most: it runs on the control loop, once a second, and
the jobs past it wait for the next pass."""
MAX_JOBS_PER_CONNECTION = 16384
"""Open lookup jobs of one connection. A vLLM scheduler holds one per request between its
lookup and its end (its running and waiting requests), far fewer than this."""
MAX_JOBS_PER_TENANT = 65536
"""Open lookup jobs of one tenant over all its connections: the schedulers of a few
engines, each well under the per-connection bound."""


def session_key(tenant: str, request_id: str) -> str:
    """A lookup's key in the table: request ids are per tenant, so one tenant can neither
    replace nor free another's lookups. Tenant names hold no NUL, so the first NUL ends
    the tenant whatever the request id holds (also for callers without a tenant)."""
    return f"{tenant}\0{request_id}"


@dataclass(slots=True)
class LookupJob:
    request_id: str
    chunk_keys: list[list[ChunkKey]]
    """Per hit chunk, its key on every rank."""
    remaining: dict[ChunkKey, int]
    """Reads still owed per key; the tier holds exactly this many locks for the job."""
    deadline: float
    hit_chunks: int | None = None
    """None while lower tiers are still being read."""
    answered: bool = False
    peer: bytes = b""
    """The connection that made the lookup."""
    tenant: str = ""
    """The tenant of the caller's credential: whose bound on locked memory the job uses."""
    capped: bool = False
    """The hit was cut short by the tenant's bound on locked memory."""
    tail: int = 0
    """Tokens of the tail that ends the hit (the last of `chunk_keys`); 0: none."""
    reply_chunk_tokens: int = 0
    """The chunk size when the asker counts its hit in tokens (it loads tails); 0 when
    it counts whole chunks."""
    state: bool = False
    """The last of `chunk_keys` is the recurrent state after the whole chunks (a hybrid
    model's hit); it holds no tokens."""

    @property
    def whole_chunks(self) -> int:
        """The hit's whole chunks (0 while pending)."""
        return (self.hit_chunks or 0) - (1 if self.tail or self.state else 0)

    def hit_tokens(self, chunk_size: int) -> int:
        """The hit's tokens: its whole chunks and its tail (0 while pending)."""
        return self.whole_chunks * chunk_size + self.tail

    def reply(self) -> int | None:
        """The hit as the asker counts it; None while lower tiers are still read."""
        if self.hit_chunks is None:
            return None
        if self.reply_chunk_tokens:
            return self.hit_tokens(self.reply_chunk_tokens)
        return self.whole_chunks


class _TenantHolds:
    """What one tenant's jobs hold: per key, how many of its jobs owe reads of it."""

    __slots__ = ("bytes", "jobs", "keys")

    def __init__(self) -> None:
        self.jobs = 0
        self.keys: Counter[ChunkKey] = Counter()
        self.bytes = 0


class LookupTable:
    def __init__(self, tier: CPUTier, lock_ttl: float, max_locked_bytes: int | None = None,
                 max_jobs: int = MAX_JOBS_PER_CONNECTION,
                 max_tenant_jobs: int = MAX_JOBS_PER_TENANT) -> None:
        self._tier = tier
        self.lock_ttl = lock_ttl
        self.max_locked_bytes = tier.capacity if max_locked_bytes is None else max_locked_bytes
        self.max_jobs = max_jobs
        self.max_tenant_jobs = max_tenant_jobs
        self._jobs: OrderedDict[str, LookupJob] = OrderedDict()
        """In deadline order (every job gets the same TTL when it starts, and a job that
        replaces another goes to the end): expiry looks only at the jobs it expires."""
        self._peer_jobs: dict[bytes, int] = {}
        self._tenants: dict[str, _TenantHolds] = {}
        self._mutex = threading.Lock()

    def __len__(self) -> int:
        return len(self._jobs)

    def summary(self) -> dict[str, int]:
        """Open jobs, the connections holding them, and what their locks hold (a key
        counted once per tenant, as the per-tenant bound counts it)."""
        with self._mutex:
            return {"lookup_jobs": len(self._jobs), "connections": len(self._peer_jobs),
                    "locked_keys": sum(len(h.keys) for h in self._tenants.values()),
                    "locked_bytes": sum(h.bytes for h in self._tenants.values())}

    def has_room(self, peer: bytes, request_id: str, tenant: str = "") -> bool:
        """Whether `peer` (of `tenant`) may open a job for `request_id` (replacing its own
        job under that id always may)."""
        holds = self._tenants.get(tenant)
        if (self._peer_jobs.get(peer, 0) < self.max_jobs
                and (holds is None or holds.jobs < self.max_tenant_jobs)):
            return True
        job = self._jobs.get(request_id)
        return job is not None and job.peer == peer

    def locked_bytes(self, tenant: str = "") -> int:
        holds = self._tenants.get(tenant)
        return 0 if holds is None else holds.bytes

    def pending_reads(self) -> int:
        """Jobs that still owe reads: retrieves the server has promised and not yet served."""
        with self._mutex:
            return sum(1 for job in self._jobs.values() if job.remaining)

    def start(self, request_id: str, chunk_keys: list[list[ChunkKey]], readers: int,
              complete: bool = True, peer: bytes = b"", tenant: str = "",
              reply_chunk_tokens: int = 0) -> LookupJob:
        """Record a job whose chunks the caller has just locked `readers` times each.

        Chunks past the tenant's bound on locked bytes are unlocked again and left
        out (`job.capped`). A complete job's count is known now (the caller may return
        it in the LOOKUP reply and set `answered`); an incomplete one grows through
        `extend` while lower tiers are read, and `finish` publishes its count."""
        with self._mutex:
            previous = self._jobs.pop(request_id, None)
            freed = self._forget(previous) if previous is not None else {}
            holds = self._tenants.setdefault(tenant, _TenantHolds())
            kept = self._hold_within_bound(holds, chunk_keys)
            job = LookupJob(
                request_id=request_id,
                chunk_keys=list(chunk_keys[:kept]),
                remaining=dict.fromkeys(itertools.chain.from_iterable(chunk_keys[:kept]),
                                        readers),
                deadline=time.monotonic() + self.lock_ttl,
                hit_chunks=kept if complete else None,
                peer=peer,
                tenant=tenant,
                capped=kept < len(chunk_keys),
                reply_chunk_tokens=reply_chunk_tokens,
            )
            holds.jobs += 1
            self._peer_jobs[peer] = self._peer_jobs.get(peer, 0) + 1
            self._jobs[request_id] = job
        self._release(freed)
        if job.capped:
            self._release(dict.fromkeys(itertools.chain.from_iterable(chunk_keys[kept:]),
                                        readers))
        return job

    def extend(self, job: LookupJob, keys: list[ChunkKey], readers: int, tail: int = 0
               ) -> bool:
        """Add a chunk (or a tail of `tail` tokens, which ends the hit) whose keys were
        just locked `readers` times; if the job has been replaced or ended meanwhile, or
        the chunk would take the tenant past its bound on locked bytes, the locks are
        given back and False returned."""
        with self._mutex:
            if self._jobs.get(job.request_id) is job and not job.tail:
                if self._hold_within_bound(self._tenants[job.tenant], [keys]):
                    job.chunk_keys.append(keys)
                    job.tail = tail
                    for key in keys:
                        job.remaining[key] = readers
                    return True
                job.capped = True
        self._release(dict.fromkeys(keys, readers))
        return False

    def finish(self, job: LookupJob) -> None:
        job.hit_chunks = len(job.chunk_keys)

    def end_at_state(self, job: LookupJob, whole: int, keys: list[ChunkKey], readers: int
                     ) -> None:
        """Cut a complete job's hit to its first `whole` chunks and end it with the state
        `keys` (locked `readers` times, by the caller, for the job) after them; the
        chunks past them are given back. With `whole` 0 the hit is empty and `keys` are
        none."""
        with self._mutex:
            freed = self._give_back(job, job.chunk_keys[whole:])
            del job.chunk_keys[whole:]
            if keys:
                if self._jobs.get(job.request_id) is job:
                    job.chunk_keys.append(keys)
                    job.state = True
                    for key in keys:
                        job.remaining[key] = readers
                    holds = self._tenants[job.tenant]
                    # As `_hold_within_bound` counts, past the bound too: one state
                    # is small beside the chunks it ends, which were counted.
                    holds.bytes += self._tier.locked_bytes([k for k in keys if not holds.keys[k]])
                    holds.keys.update(keys)
                else:
                    freed.update(dict.fromkeys(keys, readers))
                    del job.chunk_keys[:]
            job.hit_chunks = len(job.chunk_keys)
        self._release(freed)

    def query(self, request_id: str) -> int | None:
        """The hit once the job is done, as its asker counts it (`LookupJob.reply`;
        answered once); None while pending; 0 if unknown."""
        job = self._jobs.get(request_id)
        if job is None or job.answered:
            return 0
        if job.hit_chunks is None:
            return None
        job.answered = True
        return job.reply()

    def release_range(self, request_id: str, start: int, end: int, chunk_size: int) -> int:
        """Give back every read of the chunks (and the tail) lying wholly inside tokens
        [start, end); returns how many keys were freed."""
        with self._mutex:
            job = self._jobs.get(request_id)
            if job is None:
                return 0
            pieces = job.chunk_keys
            whole = len(pieces) - (1 if job.tail or job.state else 0)
            first = start // chunk_size
            inside = pieces[first:max(first, min(end // chunk_size, whole))]
            if job.tail and first <= whole and whole * chunk_size + job.tail <= end:
                inside = [*inside, pieces[whole]]
            if job.state and start < whole * chunk_size <= end:
                inside = [*inside, pieces[whole]]  # the state after the range's last chunk
            freed = self._give_back(job, inside)
        self._release(freed)
        return len(freed)

    def release_reads(self, request_id: str, keys: list[ChunkKey]) -> None:
        """A retrieve of `keys` for `request_id` finished: one read of each is done."""
        with self._mutex:
            job = self._jobs.get(request_id)
            if job is None:
                return
            freed = {}
            done = []
            for key in keys:
                count = job.remaining.get(key, 0)
                if count:
                    freed[key] = 1
                    if count == 1:
                        del job.remaining[key]
                        done.append(key)
                    else:
                        job.remaining[key] = count - 1
            self._unhold(job.tenant, done)
        self._release(freed)

    def end(self, request_id: str) -> None:
        with self._mutex:
            job = self._jobs.pop(request_id, None)
            freed = self._forget(job) if job is not None else {}
        self._release(freed)

    def expire(self, now: float | None = None, limit: int = EXPIRE_BATCH) -> int:
        """Drop up to `limit` jobs past their deadline, oldest first; returns how many (the
        rest wait for the next call, so one call's work on the control loop is bounded)."""
        now = time.monotonic() if now is None else now
        freed: Counter[ChunkKey] = Counter()
        expired = 0
        with self._mutex:
            while expired < limit and self._jobs:
                job = next(iter(self._jobs.values()))
                if job.deadline > now:
                    break
                del self._jobs[job.request_id]
                freed.update(self._forget(job))
                expired += 1
        self._release(freed)
        return expired

    def clear(self) -> None:
        with self._mutex:
            jobs, self._jobs = list(self._jobs.values()), OrderedDict()
            self._tenants.clear()
            self._peer_jobs.clear()
        for job in jobs:
            self._release(job.remaining)

    # ---- under the mutex -------------------------------------------------------------
    def _give_back(self, job: LookupJob, pieces: list[list[ChunkKey]]) -> dict[ChunkKey, int]:
        """Every read `job` still owes of `pieces` (each its keys on every rank), taken off
        the job and its tenant's holds; returns them for `_release`, after the mutex."""
        freed = {}
        for keys in pieces:
            for key in keys:
                count = job.remaining.pop(key, 0)
                if count:
                    freed[key] = count
        self._unhold(job.tenant, freed)
        return freed

    def _hold_within_bound(self, holds: _TenantHolds, chunk_keys: list[list[ChunkKey]]
                           ) -> int:
        """Count the leading chunks that fit the tenant's bound as held; returns how
        many did. Keys the tenant holds already cost nothing more."""
        held = holds.keys
        flat = [key for keys in chunk_keys for key in keys]
        added = self._tier.locked_bytes([key for key in flat if key not in held])
        if holds.bytes + added <= self.max_locked_bytes:
            # The common case, in one pass: a lookup is on a lookup's critical path.
            holds.bytes += added
            held.update(flat)
            return len(chunk_keys)
        kept = 0
        for keys in chunk_keys:
            new = [key for key in keys if not holds.keys[key]]
            added = self._tier.locked_bytes(new) if new else 0
            if holds.bytes + added > self.max_locked_bytes:
                break
            holds.bytes += added
            holds.keys.update(keys)
            kept += 1
        return kept

    def _unhold(self, tenant: str, keys: object) -> None:
        """The keys' reads owed by one of `tenant`'s jobs are all given back."""
        holds = self._tenants.get(tenant)
        if holds is None:
            return
        held = holds.keys
        gone = []
        for key in keys:  # type: ignore[attr-defined]
            left = held[key] - 1
            if left > 0:
                held[key] = left
            else:
                # dict.pop: Counter's own `del` runs Python code per key, and this runs for
                # every chunk of every ended lookup on the control thread.
                held.pop(key, None)
                gone.append(key)
        if gone:
            holds.bytes -= self._tier.locked_bytes(gone)

    def _forget(self, job: LookupJob) -> dict[ChunkKey, int]:
        """The job is out of the table: its tenant no longer holds its keys."""
        self._unhold(job.tenant, job.remaining)
        holds = self._tenants.get(job.tenant)
        if holds is not None:
            holds.jobs -= 1
            if holds.jobs <= 0 and not holds.keys:
                del self._tenants[job.tenant]
        left = self._peer_jobs.get(job.peer, 0) - 1
        if left > 0:
            self._peer_jobs[job.peer] = left
        else:
            self._peer_jobs.pop(job.peer, None)
        return job.remaining

    def _release(self, counts: dict[ChunkKey, int]) -> None:
        if counts:
            self._tier.unlock(counts)
