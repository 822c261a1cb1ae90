"""Lookup jobs: which chunks a request was promised, and the read locks behind the promise.

A LOOKUP locks every chunk of the hit (on every rank) with as many reads as the request
will make. Each retrieve gives back the reads it made; FREE_LOOKUP_LOCKS gives back
chunks that will never be read; END_SESSION and the TTL give back whatever is left, so
a crashed or forgetful engine cannot pin memory forever.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

from kvdepot.keys import ChunkKey
from kvdepot.storage.cpu_tier import CPUTier


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


class LookupTable:
    def __init__(self, tier: CPUTier, lock_ttl: float) -> None:
        self._tier = tier
        self.lock_ttl = lock_ttl
        self._jobs: dict[str, LookupJob] = {}
        self._mutex = threading.Lock()

    def __len__(self) -> int:
        return len(self._jobs)

    def start(self, request_id: str, chunk_keys: list[list[ChunkKey]], readers: int,
              complete: bool = True) -> LookupJob:
        """Record a job whose chunks the caller has just locked `readers` times each.

        A complete job's count is known now (the caller may return it in the LOOKUP reply
        and set `answered`); an incomplete one grows through `extend` while lower tiers
        are read, and `finish` publishes its count."""
        job = LookupJob(
            request_id=request_id,
            chunk_keys=list(chunk_keys),
            remaining=dict.fromkeys(itertools.chain.from_iterable(chunk_keys), readers),
            deadline=time.monotonic() + self.lock_ttl,
            hit_chunks=len(chunk_keys) if complete else None,
        )
        with self._mutex:
            previous = self._jobs.pop(request_id, None)
            self._jobs[request_id] = job
        if previous is not None:
            self._release(previous.remaining)
        return job

    def extend(self, job: LookupJob, keys: list[ChunkKey], readers: int) -> bool:
        """Add a chunk whose keys were just locked `readers` times; if the job has been
        replaced or ended meanwhile, the locks are given back and False returned."""
        with self._mutex:
            if self._jobs.get(job.request_id) is job:
                job.chunk_keys.append(keys)
                for key in keys:
                    job.remaining[key] = readers
                return True
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
        self._release(freed)
        return len(freed)

    def release_reads(self, request_id: str, keys: list[ChunkKey]) -> None:
        """A retrieve of `keys` for `request_id` finished: one read of each is done."""
        with self._mutex:
            job = self._jobs.get(request_id)
            if job is None:
                return
            freed = {}
            for key in keys:
                count = job.remaining.get(key, 0)
                if count:
                    freed[key] = 1
                    if count == 1:
                        del job.remaining[key]
                    else:
                        job.remaining[key] = count - 1
        self._release(freed)

    def end(self, request_id: str) -> None:
        with self._mutex:
            job = self._jobs.pop(request_id, None)
        if job is not None:
            self._release(job.remaining)

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._mutex:
            expired = [job for job in self._jobs.values() if job.deadline <= now]
            for job in expired:
                del self._jobs[job.request_id]
        for job in expired:
            self._release(job.remaining)
        return len(expired)

    def clear(self) -> None:
        with self._mutex:
            jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            self._release(job.remaining)

    def _release(self, counts: dict[ChunkKey, int]) -> None:
        if counts:
            self._tier.unlock(counts)
