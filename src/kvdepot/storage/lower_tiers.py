"""Moving chunks between CPU memory and the tiers below it.

Write-behind: every chunk committed to CPU memory is queued for each lower tier; a
thread per tier takes what has queued up as one batch, pins those chunks (so eviction
cannot pull them away mid-write) and hands the batch to the tier in one call. Each
queue is bounded: past it new chunks skip that tier and are counted, and a store never
waits on a lower tier.

Promotion: a lookup that runs past what CPU memory holds asks the lower tiers for the
rest of its prefix in batches (one call per tier for the sizes, one per tier per
window of chunks for the bytes), reserves CPU extents for the leading run they hold,
reads straight into them, and commits them with the lookup's read locks. A lookup that
says how fast its engine prefills is promoted only as far as loading beats computing
(`load_speed`); the chunks it leaves are counted per tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import NamedTuple

from kvdepot.errors import ChunkMissing
from kvdepot.keys import HASH_BYTES, ChunkKey
from kvdepot.metrics import Counter
from kvdepot.storage.chunk import UNSCOPED, Chunk, ChunkScope
from kvdepot.storage.cpu_tier import CPUTier, ReserveOutcome
from kvdepot.storage.load_speed import TierSpeed, chunks_worth_loading
from kvdepot.storage.tier import ChunkWrite, LowerTier

log = logging.getLogger(__name__)

WRITE_QUEUE_CHUNKS = 4096
"""Beyond this backlog (per tier) new chunks skip the tier rather than grow memory use."""
WRITE_BATCH_CHUNKS = 64
"""The most chunks one write-behind call hands a tier (and keeps pinned meanwhile)."""
PROMOTION_WINDOW_BYTES = 1 << 30
"""Bytes read from lower tiers per round of a promotion: a long prefix is read in
windows, so one lookup neither evicts much more than it will use before its first
bytes arrive nor holds the bytes of a whole prompt in flight. Each window ends with
every shard of the cluster drained and waiting for the slowest: windows of a quarter
of this read 6 masters 30 % slower (docs/shared-tier.md)."""


class Promoted(NamedTuple):
    """What a promotion made of a prompt's leading chunks (`LowerTiers.bring_up_prefix`)."""

    run: int
    """Leading chunks present in CPU memory, locked."""
    held: int
    """Leading chunks CPU memory or a lower tier held."""
    tail: int | None = None
    """Which of the tails offered after the chunks is present in CPU memory, locked;
    None: none (or none was offered)."""


class _TierWriter:
    """One lower tier's write-behind queue and thread."""

    def __init__(self, memory: CPUTier, tier: LowerTier, written: Counter,
                 dropped: Counter, speed: TierSpeed) -> None:
        self.memory = memory
        self.tier = tier
        self.speed = speed
        self._pool = memory.pool.numpy()
        self.queue: queue.Queue[ChunkKey | None] = queue.Queue(WRITE_QUEUE_CHUNKS)
        self.written = written
        self.dropped = dropped
        self._waiting = 0
        """Chunks queued and not yet done with (written, skipped or failed): the queue's
        depth counts the batch being written too."""
        self._waiting_mutex = threading.Lock()
        tier.attach_write_queue(lambda: self._waiting)
        self._thread = threading.Thread(target=self._loop, name=f"kvdepot-{tier.name}-writer",
                                        daemon=True)
        self._thread.start()

    def submit(self, keys: list[ChunkKey]) -> None:
        dropped = len(keys)
        if self.tier.available:  # else drop at once: a queue would only fill and go stale
            with self._waiting_mutex:
                for key in keys:
                    try:
                        self.queue.put_nowait(key)
                        dropped -= 1
                        self._waiting += 1
                    except queue.Full:
                        break
        if dropped:
            self.dropped.add(dropped)
            self.tier.count_dropped(dropped)

    def _loop(self) -> None:
        self._calibrate()
        stopping = False
        while not stopping:
            batch = [self.queue.get()]
            while len(batch) < WRITE_BATCH_CHUNKS:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            if None in batch:
                stopping = True
                batch = [key for key in batch if key is not None]
            try:
                self._write(batch)  # type: ignore[arg-type]
            except Exception:
                log.exception("writing chunks to the %s tier failed", self.tier.name)
            with self._waiting_mutex:
                self._waiting -= len(batch)

    def _calibrate(self) -> None:
        """The tier's first speed figures, before any lookup needs them."""
        try:
            probe = self.tier.probe()
        except Exception:
            log.exception("probing the %s tier failed", self.tier.name)
            return
        if probe is not None:
            self.speed.observe_round_trip(probe.round_trip_s)
            self.speed.observe_write(probe.nbytes, probe.write_s)
            self.speed.observe_read(probe.nbytes, probe.read_s)

    def _write(self, keys: list[ChunkKey]) -> None:
        pinned: list[Chunk] = []
        for key in keys:
            try:
                pinned += self.memory.pin([key])
            except ChunkMissing:
                continue  # evicted before its turn came
        try:
            writes: list[ChunkWrite] = [
                (chunk.key, chunk.fingerprint,
                 memoryview(self._pool[chunk.offset:chunk.offset + chunk.nbytes]),
                 chunk.scope, chunk.parent)
                for chunk in pinned]
            started = time.perf_counter()
            written = self.tier.write_many(writes)
            if written == len(writes):  # else some were skipped: the time says nothing
                self.speed.observe_write(sum(chunk.nbytes for chunk in pinned),
                                         time.perf_counter() - started)
            self.written.add(written)
        finally:
            self.memory.unpin(pinned)

    def close(self) -> None:
        try:
            self.queue.put(None, timeout=5)
        except queue.Full:
            return
        self._thread.join(timeout=30)


class LowerTiers:
    def __init__(self, memory: CPUTier, tiers: list[LowerTier], *,
                 written: Counter | None = None, promoted: Counter | None = None,
                 dropped_writes: Counter | None = None,
                 skipped_slower: dict[str, Counter] | None = None) -> None:
        """`skipped_slower`: per tier name, the count of chunks a lookup left to the
        engine because loading them would have taken longer than computing them."""
        self.memory = memory
        self.tiers = tiers
        self._pool = memory.pool.numpy()
        self.written = written or Counter()
        self.promoted = promoted or Counter()
        self.dropped_writes = dropped_writes or Counter()
        self.speeds = {tier.name: TierSpeed() for tier in tiers}
        self.skipped_slower = {tier.name: (skipped_slower or {}).get(tier.name) or Counter()
                               for tier in tiers}
        self._writers = [_TierWriter(memory, tier, self.written, self.dropped_writes,
                                     self.speeds[tier.name])
                         for tier in tiers]

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def reachable(self) -> bool:
        """Whether some lower tier can be asked now."""
        return any(tier.available for tier in self.tiers)

    def hold_without_io(self, keys: list[ChunkKey]) -> bool:
        """Whether some reachable tier is known, from its index in memory, to hold every
        key (False where it would take a read or a round trip to tell)."""
        return any(tier.available and all(tier.holds_without_io(key) for key in keys)
                   for tier in self.tiers)

    # ---- write-behind -----------------------------------------------------------------
    def write_behind(self, keys: list[ChunkKey]) -> None:
        for writer in self._writers:
            writer.submit(keys)

    def close(self) -> None:
        """Write behind every chunk queued so far, then stop."""
        for writer in self._writers:
            writer.close()
        for tier in self.tiers:
            tier.close()

    # ---- promotion ---------------------------------------------------------------------
    def bring_up(self, key: ChunkKey, locks: int, scope: ChunkScope = UNSCOPED,
                 parent: bytes | None = None) -> bool:
        """Make `key` present in CPU memory holding `locks` read locks; False if no tier
        has it (or it could not be read or find room)."""
        return self.bring_up_run([[key]], locks, scope, parent) == 1

    def bring_up_run(self, chunks: list[list[ChunkKey]], locks: int,
                     scope: ChunkScope = UNSCOPED, parent: bytes | None = None,
                     compute_seconds_per_chunk: float | None = None) -> int:
        """`bring_up_prefix`'s run alone."""
        return self.bring_up_prefix(chunks, locks, scope, parent,
                                    compute_seconds_per_chunk).run

    def bring_up_prefix(self, chunks: list[list[ChunkKey]], locks: int,
                        scope: ChunkScope = UNSCOPED, parent: bytes | None = None,
                        compute_seconds_per_chunk: float | None = None,
                        tails: list[list[ChunkKey]] | None = None,
                        tail_compute_seconds: list[float] | None = None) -> Promoted:
        """Make the leading chunks (each its keys on every rank) present in CPU memory,
        each key holding `locks` read locks; returns how many leading chunks are (`run`),
        and how many leading chunks CPU memory or a lower tier held (`held`: the run falls
        short of it where loading was slower, or failed). Keys of later chunks hold no
        locks when this returns. Chunks read up are stored as `scope`'s (the lookup's:
        keys are scoped, so it is the one that stored them), under its quota; `parent` is
        the hash of the chunk before the first. `compute_seconds_per_chunk`: how long the
        asking engine takes to compute one chunk; if given, only the prefix that loads
        faster than that is read.

        `tails`: alternatives for what follows the last chunk (a prompt's possible tails,
        longest first; each its keys on every rank). If every chunk is brought up, so is
        the first tail some tier holds whole and that loads faster than the engine
        computes it (`tail_compute_seconds[i]`), asked for and read in the same round
        trips as the chunks (`Promoted.tail`)."""
        tails = tails or []
        sources = self._sources([key for keys in chunks for key in keys],
                                [key for keys in tails for key in keys])
        wanted = len(chunks)
        held = next((i for i, keys in enumerate(chunks) if not self._held(keys, sources)),
                    wanted)
        if compute_seconds_per_chunk is not None:
            chunks = self._worth_loading(chunks, sources, compute_seconds_per_chunk)
        tail = None
        if held == wanted and len(chunks) == wanted:
            tail = self._first_tail(tails, sources, tail_compute_seconds)
        # The tail rides at the end of the last window: it is kept only if every chunk is.
        items = chunks if tail is None else [*chunks, tails[tail]]
        done = 0
        while done < len(items):
            window, window_bytes = [], 0
            for keys in items[done:]:
                window.append(keys)
                window_bytes += sum(sources.get(key, (None, 0))[1] for key in keys)
                if window_bytes >= PROMOTION_WINDOW_BYTES:
                    break
            first_parent = items[done - 1][0][:HASH_BYTES] if done else parent
            got = self._bring_up_window(window, sources, locks, scope, first_parent)
            done += got
            if got < len(window):
                break
        if tail is not None and done == len(items):
            return Promoted(wanted, held, tail)
        return Promoted(min(done, len(chunks)), held)

    def _first_tail(self, tails: list[list[ChunkKey]],
                    sources: dict[ChunkKey, tuple[LowerTier, int]],
                    compute_seconds: list[float] | None) -> int | None:
        """The first of `tails` that CPU memory or a lower tier holds whole and whose load
        pays off."""
        return next((index for index, keys in enumerate(tails) if self._loadable(
            keys, sources, None if compute_seconds is None else compute_seconds[index])),
            None)

    def _held(self, keys: list[ChunkKey], sources: dict[ChunkKey, tuple[LowerTier, int]]
              ) -> bool:
        """Whether CPU memory or a lower tier holds every key of one chunk."""
        contains = self.memory.contains
        return all(key in sources or contains(key) for key in keys)

    def _loadable(self, keys: list[ChunkKey], sources: dict[ChunkKey, tuple[LowerTier, int]],
                  compute_seconds: float | None) -> bool:
        """Whether one chunk is held whole and loads faster than `compute_seconds` (None:
        no engine rate given); a held chunk left as slower is counted against its tiers."""
        return self._held(keys, sources) and (
            compute_seconds is None
            or bool(self._worth_loading([keys], sources, compute_seconds)))

    def bring_up_first(self, candidates: list[list[ChunkKey]], locks: int,
                       scope: ChunkScope = UNSCOPED, parent: bytes | None = None,
                       compute_seconds: list[float] | None = None) -> int | None:
        """Make the first of `candidates` (alternatives, such as a prompt's possible tails
        longest first; each its keys on every rank) that CPU memory or a lower tier holds
        whole present in CPU memory with `locks` read locks; returns its index, None if
        none could be. `compute_seconds[i]`: how long the engine takes to compute
        candidate i; one that loads slower is passed over."""
        sources = self._sources([], [key for keys in candidates for key in keys])
        for index, keys in enumerate(candidates):
            compute = None if compute_seconds is None else compute_seconds[index]
            if (self._loadable(keys, sources, compute)
                    and self._bring_up_window([keys], sources, locks, scope, parent) == 1):
                return index
        return None

    def _worth_loading(self, chunks: list[list[ChunkKey]],
                       sources: dict[ChunkKey, tuple[LowerTier, int]],
                       compute_seconds_per_chunk: float) -> list[list[ChunkKey]]:
        """The leading chunks whose load pays off; the held chunks left out are counted
        against the tiers that hold them."""
        reads: list[dict[str, int]] = []
        for keys in chunks:
            per_tier: dict[str, int] = {}
            for key in keys:
                source = sources.get(key)
                if source is None:
                    if self.memory.contains(key):
                        continue
                    break  # no tier holds it: the run ends here
                per_tier[source[0].name] = per_tier.get(source[0].name, 0) + source[1]
            else:
                reads.append(per_tier)
                continue
            break
        worth = chunks_worth_loading(reads, self.speeds, compute_seconds_per_chunk)
        for per_tier in reads[worth:]:
            for name in per_tier:
                self.skipped_slower[name].add(1)
        return chunks[:worth]

    def _sources(self, run: list[ChunkKey], alternatives: list[ChunkKey]
                 ) -> dict[ChunkKey, tuple[LowerTier, int]]:
        """For the keys not in CPU memory, the first tier holding each and its size; each
        tier is asked once, about what earlier tiers lack. Of `run` only the leading run
        is found; each of `alternatives` (not a run: a prompt's possible tails) is."""
        contains = self.memory.contains
        wanted = [key for key in run if not contains(key)]
        wanted_each = [key for key in alternatives if not contains(key)]
        found: dict[ChunkKey, tuple[LowerTier, int]] = {}
        for tier in self.tiers:
            if not (wanted or wanted_each) or not tier.available:
                continue
            started = time.perf_counter()
            asked = wanted + wanted_each
            sizes = (tier.stored_sizes_of_each(asked) if wanted_each
                     else tier.stored_sizes(asked))
            self.speeds[tier.name].observe_round_trip(time.perf_counter() - started)
            for key, size in zip(asked, sizes, strict=True):
                if size is not None:
                    found[key] = (tier, size)
            wanted = [key for key in wanted if key not in found]
            wanted_each = [key for key in wanted_each if key not in found]
        return found

    def _bring_up_window(self, window: list[list[ChunkKey]],
                         sources: dict[ChunkKey, tuple[LowerTier, int]], locks: int,
                         scope: ChunkScope, parent: bytes | None) -> int:
        """Lock or read up every chunk of `window` it can, in order; returns the length
        of the leading run that made it, with the locks of later chunks given back."""
        locked: list[list[ChunkKey]] = []  # per chunk, its keys that were already present
        reading: dict[LowerTier, list[Chunk]] = {}
        chunk_index: dict[ChunkKey, int] = {}
        run = len(window)
        for index, keys in enumerate(window):
            taken: list[ChunkKey] = []
            locked.append(taken)
            for key in keys:
                if self.memory.lock_if_present(key, locks):
                    taken.append(key)
                    continue
                source = sources.get(key)
                if source is None:
                    break
                chunk_parent = window[index - 1][0][:HASH_BYTES] if index else parent
                outcome, chunk = self.memory.reserve(key, source[1], b"", scope, chunk_parent)
                if outcome is ReserveOutcome.PRESENT and self.memory.lock_if_present(key, locks):
                    taken.append(key)
                    continue
                if chunk is None:
                    break  # being written by someone else, or memory full of locked chunks
                reading.setdefault(source[0], []).append(chunk)
                chunk_index[key] = index
            else:
                continue
            run = index
            break
        read: list[Chunk] = []
        for tier, chunks in reading.items():
            started = time.perf_counter()
            fingerprints = tier.read_many([
                (chunk.key, memoryview(self._pool[chunk.offset:chunk.offset + chunk.nbytes]))
                for chunk in chunks])
            if all(fingerprint is not None for fingerprint in fingerprints):
                self.speeds[tier.name].observe_read(sum(chunk.nbytes for chunk in chunks),
                                                    time.perf_counter() - started)
            for chunk, fingerprint in zip(chunks, fingerprints, strict=True):
                if fingerprint is None:
                    self.memory.abort(chunk)
                    run = min(run, chunk_index[chunk.key])
                else:
                    chunk.fingerprint = fingerprint
                    read.append(chunk)
        for chunk in read:
            # Chunks read past the run stay in CPU memory, unlocked.
            self.memory.commit(chunk, locks if chunk_index[chunk.key] < run else 0)
        self.promoted.add(len(read))
        for keys in locked[run:]:
            self.memory.unlock(dict.fromkeys(keys, locks))
        return run
