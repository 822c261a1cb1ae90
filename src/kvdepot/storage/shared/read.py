"""One read of the shared tier, streamed: the commands of a run of chunks, and what
becomes of each chunk as its pieces land.

Pieces land on the masters' threads in each master's own order. Each is hashed on the
thread that received it, as it lands (while it is still in the CPU's cache), and a chunk
is verified when its last piece lands, whichever master carried it, from its pieces'
hashes alone: no pass over the chunk is left for after the network. A chunk that cannot
be served (a piece missing, short or of another type; a checksum that fails; a
connection lost before its pieces came) ends the run there, so the jobs after it are not
sent.
"""

from __future__ import annotations

import threading

from kvdepot.keys import ChunkKey
from kvdepot.storage.shared import shard_io, value

Verdict = bool | None
"""A chunk's outcome: True verified, False damaged (delete it), None not delivered (a
connection failed, or the run ended before it)."""


class StreamedRead:
    """The jobs of a run of chunks (`reads[i]` with `head`, for each planned (i, head)):
    per chunk its pieces' GETEX, then its head's EXPIRE (both restart the TTL)."""

    def __init__(self, reads: list[tuple[ChunkKey, memoryview]],
                 planned: list[tuple[int, value.Head]], ttl: int) -> None:
        self._reads = reads
        self._planned = planned
        self.jobs: list[shard_io.Job] = []
        self._owner: list[int] = []  # per job: its chunk's position in `planned`
        self._piece: list[int] = []  # per job: its piece's index in its chunk (-1: the head)
        self._first_job: list[int] = []
        self._digests: list[list[bytes]] = []  # per chunk: its pieces' hashes, as they land
        self._missing: list[int] = []  # per chunk: pieces not landed yet
        self._verdicts: list[Verdict] = [None] * len(planned)
        self._mutex = threading.Lock()
        for position, (i, head) in enumerate(planned):
            key, buffer = reads[i]
            target = buffer.cast("B") if buffer.format != "B" else buffer
            self._first_job.append(len(self.jobs))
            self._digests.append([b""] * head.pieces)
            self._missing.append(head.pieces)
            for index, name in enumerate(value.piece_keys(key, head.pieces)):
                start, end = head.piece_span(index)
                self.jobs.append((name, ("GETEX", name, "EX", ttl), target[start:end]))
                self._owner.append(position)
                self._piece.append(index)
            name = value.head_key(key)
            self.jobs.append((name, ("EXPIRE", name, ttl), None))
            self._owner.append(position)
            self._piece.append(-1)
        self.cutoff = shard_io.Cutoff(len(self.jobs))

    def landed(self, index: int, good: bool) -> None:
        """On a master's thread: job `index` answered (`good`: a piece of the right
        length landed, or the head's EXPIRE was answered)."""
        position, piece, target = self._owner[index], self._piece[index], self.jobs[index][2]
        if target is None:
            return  # a head's EXPIRE: whatever it answers, the checksum decides
        if not good:
            self._settle(position, False)
            return
        digest = value.piece_digest(target)
        with self._mutex:
            self._digests[position][piece] = digest
            self._missing[position] -= 1
            complete = self._missing[position] == 0 and self._verdicts[position] is None
        if complete:
            i, head = self._planned[position]
            self._settle(position, value.verify_pieces(self._reads[i][0], head,
                                                       self._digests[position]))

    def _settle(self, position: int, verified: bool) -> None:
        with self._mutex:
            if self._verdicts[position] is not False:
                self._verdicts[position] = verified
        if not verified:
            self.cutoff.lower(self._first_job[position])

    def verdicts(self) -> list[Verdict]:
        """Each chunk's outcome, once every master's thread is done."""
        with self._mutex:
            return list(self._verdicts)
