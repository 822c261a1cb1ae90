"""Lookup jobs: which chunks a request was promised, and the read locks behind the promise.

A LOOKUP locks every chunk of the hit (on every rank) with as many reads as the request
will make. Each retrieve gives back the reads it made; FREE_LOOKUP_LOCKS gives back
chunks that will never be read; END_SESSION and the TTL give back whatever is left, so
a crashed or forgetful engine cannot pin memory forever.

Per connection (the scheduler client that sent the lookups) the table bounds how many
jobs are open and how many bytes of CPU memory their locks hold: a chunk counts once
per connection however many of its jobs hold it, so a prefix that every request shares
costs its size once. A lookup past the byte bound locks a shorter prefix (the engine
computes the rest); one past the job bound is refused (0 hits).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass

from kvdepot.keys import ChunkKey
from kvdepot.storage.cpu_tier import CPUTier

MAX_JOBS_PER_CONNECTION = 16384
"""Open lookup jobs of one connection. A vLLM scheduler holds one per request between its
lookup and its end (its running and waiting requests), far fewer than this."""


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
    capped: bool = False
    """The hit was cut short by the connection's bound on locked memory."""


class _PeerHolds:
    """What one connection's jobs hold: per key, how many of its jobs owe reads of it."""

    __slots__ = ("bytes", "jobs", "keys")

    def __init__(self) -> None:
        self.jobs = 0
        self.keys: Counter[ChunkKey] = Counter()
        self.bytes = 0


class LookupTable:
    def __init__(self, tier: CPUTier, lock_ttl: float, max_locked_bytes: int | None = None,
                 max_jobs: int = MAX_JOBS_PER_CONNECTION) -> None:
        self._tier = tier
        self.lock_ttl = lock_ttl
        self.max_locked_bytes = tier.capacity if max_locked_bytes is None else max_locked_bytes
        self.max_jobs = max_jobs
        self._jobs: dict[str, LookupJob] = {}
        self._peers: dict[bytes, _PeerHolds] = {}
        self._mutex = threading.Lock()

    def __len__(self) -> int:
        return len(self._jobs)

    def has_room(self, peer: bytes, request_id: str) -> bool:
        """Whether `peer` may open a job for `request_id` (replacing its own job under
        that id always may)."""
        holds = self._peers.get(peer)
        if holds is None or holds.jobs < self.max_jobs:
            return True
        job = self._jobs.get(request_id)
        return job is not None and job.peer == peer

    def locked_bytes(self, peer: bytes) -> int:
        holds = self._peers.get(peer)
        return 0 if holds is None else holds.bytes

    def start(self, request_id: str, chunk_keys: list[list[ChunkKey]], readers: int,
              complete: bool = True, peer: bytes = b"") -> LookupJob:
        """Record a job whose chunks the caller has just locked `readers` times each.

        Chunks past the connection's bound on locked bytes are unlocked again and left
        out (`job.capped`). A complete job's count is known now (the caller may return
        it in the LOOKUP reply and set `answered`); an incomplete one grows through
        `extend` while lower tiers are read, and `finish` publishes its count."""
        with self._mutex:
            previous = self._jobs.pop(request_id, None)
            freed = self._forget(previous) if previous is not None else {}
            holds = self._peers.setdefault(peer, _PeerHolds())
            kept = self._hold_within_bound(holds, chunk_keys)
            job = LookupJob(
                request_id=request_id,
                chunk_keys=list(chunk_keys[:kept]),
                remaining=dict.fromkeys(itertools.chain.from_iterable(chunk_keys[:kept]),
                                        readers),
                deadline=time.monotonic() + self.lock_ttl,
                hit_chunks=kept if complete else None,
                peer=peer,
                capped=kept < len(chunk_keys),
            )
            holds.jobs += 1
            self._jobs[request_id] = job
        self._release(freed)
        if job.capped:
            self._release(dict.fromkeys(itertools.chain.from_iterable(chunk_keys[kept:]),
                                        readers))
        return job

    def extend(self, job: LookupJob, keys: list[ChunkKey], readers: int) -> bool:
        """Add a chunk whose keys were just locked `readers` times; if the job has been
        replaced or ended meanwhile, or the chunk would take the connection past its
        bound on locked bytes, the locks are given back and False returned."""
        with self._mutex:
            if self._jobs.get(job.request_id) is job:
                if self._hold_within_bound(self._peers[job.peer], [keys]):
                    job.chunk_keys.append(keys)
                    for key in keys:
                        job.remaining[key] = readers
                    return True
                job.capped = True
        self._release(dict.fromkeys(keys, readers))
        return False

    def finish(self, job: LookupJob) -> None:
        job.hit_chunks = len(job.chunk_keys)

    def query(self, request_id: str) -> int | None:
        """Hit chunks once the job is done (answered once); None while pending; 0 if unknown."""
        job = self._jobs.get(request_id)
        if job is None or job.answered:
            return 0
        if job.hit_chunks is None:
            return None
        job.answered = True
        return job.hit_chunks

    def release_chunks(self, request_id: str, first_chunk: int, end_chunk: int) -> int:
        """Give back every read of chunks [first_chunk, end_chunk); returns how many chunks."""
        with self._mutex:
            job = self._jobs.get(request_id)
            if job is None:
                return 0
            freed = {}
            for keys in job.chunk_keys[max(0, first_chunk):max(0, end_chunk)]:
                for key in keys:
                    count = job.remaining.pop(key, 0)
                    if count:
                        freed[key] = count
            self._unhold(job.peer, freed)
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
            self._unhold(job.peer, done)
        self._release(freed)

    def end(self, request_id: str) -> None:
        with self._mutex:
            job = self._jobs.pop(request_id, None)
            freed = self._forget(job) if job is not None else {}
        self._release(freed)

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        freed: Counter[ChunkKey] = Counter()
        with self._mutex:
            expired = [job for job in self._jobs.values() if job.deadline <= now]
            for job in expired:
                del self._jobs[job.request_id]
                freed.update(self._forget(job))
        self._release(freed)
        return len(expired)

    def clear(self) -> None:
        with self._mutex:
            jobs, self._jobs = list(self._jobs.values()), {}
            self._peers.clear()
        for job in jobs:
            self._release(job.remaining)

    # ---- under the mutex -------------------------------------------------------------
    def _hold_within_bound(self, holds: _PeerHolds, chunk_keys: list[list[ChunkKey]]) -> int:
        """Count the leading chunks that fit the connection's bound as held; returns how
        many did. Keys the connection holds already cost nothing more."""
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

    def _unhold(self, peer: bytes, keys: object) -> None:
        """The keys' reads owed by one of `peer`'s jobs are all given back."""
        holds = self._peers.get(peer)
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
        """The job is out of the table: its connection no longer holds its keys."""
        self._unhold(job.peer, job.remaining)
        holds = self._peers.get(job.peer)
        if holds is not None:
            holds.jobs -= 1
            if holds.jobs <= 0 and not holds.keys:
                del self._peers[job.peer]
        return job.remaining

    def _release(self, counts: dict[ChunkKey, int]) -> None:
        if counts:
            self._tier.unlock(counts)
