"""One read of the shared tier, streamed: the commands of a run of chunks, and what
becomes of each chunk as its pieces land.

Pieces land on the masters' threads in each master's own order, so a chunk is complete
when its last piece lands, whichever master carried it; it is then verified on a helper
thread while the rest of the run is still on the network. A chunk that cannot be served
(a piece missing, short or of another type; a checksum that fails; a connection lost
before its pieces came) ends the run there, so the jobs after it are not sent.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from kvdepot.keys import ChunkKey
from kvdepot.storage import remote_value as value
from kvdepot.storage import shard_io

Verdict = bool | None
"""A chunk's outcome: True verified, False damaged (delete it), None not delivered (a
connection failed, or the run ended before it)."""


class StreamedRead:
    """The jobs of a run of chunks (`reads[i]` with `head`, for each planned (i, head)):
    per chunk its pieces' GETEX, then its head's EXPIRE (both restart the TTL)."""

    def __init__(self, reads: list[tuple[ChunkKey, memoryview]],
                 planned: list[tuple[int, value.Head]], ttl: int,
                 helper: ThreadPoolExecutor) -> None:
        self._reads = reads
        self._planned = planned
        self._helper = helper
        self.jobs: list[shard_io.Job] = []
        self._owner: list[int] = []  # per job: its chunk's position in `planned`
        self._first_job: list[int] = []
        self._missing: list[int] = []  # per chunk: pieces not landed yet
        self._damaged = [False] * len(planned)
        self._checks: dict[int, Future[bool]] = {}
        self._mutex = threading.Lock()
        for position, (i, head) in enumerate(planned):
            key, buffer = reads[i]
            target = buffer.cast("B") if buffer.format != "B" else buffer
            self._first_job.append(len(self.jobs))
            self._missing.append(head.pieces)
            for index, name in enumerate(value.piece_keys(key, head.pieces)):
                start, end = head.piece_span(index)
                self.jobs.append((name, ("GETEX", name, "EX", ttl), target[start:end]))
                self._owner.append(position)
            name = value.head_key(key)
            self.jobs.append((name, ("EXPIRE", name, ttl), None))
            self._owner.append(position)
        self.cutoff = shard_io.Cutoff(len(self.jobs))

    def landed(self, index: int, good: bool) -> None:
        """On a master's thread: job `index` answered (`good`: a piece of the right
        length landed, or the head's EXPIRE was answered)."""
        position = self._owner[index]
        if self.jobs[index][2] is None:
            return  # a head's EXPIRE: whatever it answers, the checksum decides
        if not good:
            self._damage(position)
            return
        with self._mutex:
            self._missing[position] -= 1
            complete = self._missing[position] == 0 and not self._damaged[position]
        if complete:
            self._checks[position] = self._helper.submit(self._verify, position)

    def _verify(self, position: int) -> bool:
        i, head = self._planned[position]
        key, buffer = self._reads[i]
        if value.verify(key, head, buffer):
            return True
        self._damage(position)
        return False

    def _damage(self, position: int) -> None:
        with self._mutex:
            self._damaged[position] = True
        self.cutoff.lower(self._first_job[position])

    def verdicts(self) -> list[Verdict]:
        """Each chunk's outcome, once no helper reads a buffer any more."""
        outcome: list[Verdict] = [None] * len(self._planned)
        for position, check in list(self._checks.items()):
            outcome[position] = check.result()
        for position, damaged in enumerate(self._damaged):
            if damaged:
                outcome[position] = False
        return outcome
