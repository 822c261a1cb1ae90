"""Whether loading a prefix from a lower tier beats computing it.

Each lower tier's speed is measured as it works: the round trip of every size query
(the latency a read pays before its first byte) and the rate of every read and every
write-behind batch. A lookup that carries its engine's prefill rate loads from a lower
tier only the longest prefix whose load is expected to end before the engine could have
computed those tokens; the rest the engine computes.

Reads and write-behind batches cross the same link, so both measure it, and every store
keeps the write figure fresh: the slower of the two figures taken within the last
minute is trusted (or, if neither is that recent, the newer one). A link that slows down
is then seen by the next batch of writes, before a read crawls over it, and one that got
faster is seen without risking a slow read to find out. Figures are averaged as seconds
per byte, not bytes per second, so one slow batch weighs as much as it costs: the
average follows a slowdown at once and a recovery over a few batches. A tier that can
(the shared tier) is probed as its writer starts, so the first lookup already has figures;
one never measured at all is assumed to pay off (the first read measures it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

SMOOTHING = 0.5
"""Weight of the newest sample in each moving average: a handful of batches follow a
link that changed by a factor of a hundred."""
FRESH_S = 60.0
"""Figures older than this give way to newer ones."""
MIN_TRANSFER_SHARE = 0.25
"""A batch's transfer time is its time less the round trip, but never less than this
share of it: a read or write of one small chunk is mostly round trip, and the difference of two
noisy figures must not make the tier look infinitely fast."""


class _Average:
    __slots__ = ("at", "value")

    def __init__(self) -> None:
        self.value: float | None = None
        self.at = 0.0

    def add(self, sample: float, now: float) -> None:
        self.value = sample if self.value is None else (
            self.value + SMOOTHING * (sample - self.value))
        self.at = now


class TierSpeed:
    """One lower tier's measured round trip and bandwidth (thread-safe)."""

    def __init__(self) -> None:
        self._round_trip = _Average()
        self._read = _Average()
        self._write = _Average()
        self._mutex = threading.Lock()

    def observe_round_trip(self, seconds: float) -> None:
        with self._mutex:
            self._round_trip.add(seconds, time.monotonic())

    def observe_read(self, nbytes: int, seconds: float) -> None:
        self._observe(self._read, nbytes, seconds)

    def observe_write(self, nbytes: int, seconds: float) -> None:
        self._observe(self._write, nbytes, seconds)

    def _observe(self, average: _Average, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._mutex:
            latency = self._round_trip.value or 0.0
            transfer = max(seconds - latency, seconds * MIN_TRANSFER_SHARE)
            average.add(transfer / nbytes, time.monotonic())

    def bytes_per_s(self) -> float | None:
        """The bandwidth a read is expected to get; None if never measured."""
        with self._mutex:
            measured = [a for a in (self._read, self._write) if a.value is not None]
            if not measured:
                return None
            now = time.monotonic()
            fresh = [a.value for a in measured if now - a.at < FRESH_S]
            per_byte = max(fresh) if fresh else max(measured, key=lambda a: a.at).value
            assert per_byte is not None
            return 1.0 / per_byte

    def read_cost(self) -> tuple[float, float] | None:
        """(round trip in seconds, bytes per second) a read is expected to pay; None if
        the tier was never measured."""
        rate = self.bytes_per_s()
        if rate is None:
            return None
        return self._round_trip.value or 0.0, rate

    def read_seconds(self, nbytes: int) -> float | None:
        """Expected time to read `nbytes` in one batch; None if the tier was never
        measured."""
        cost = self.read_cost()
        return None if cost is None else cost[0] + nbytes / cost[1]

    def status(self) -> dict[str, float | None]:
        rate = self.bytes_per_s()
        latency = self._round_trip.value
        return {"read_bytes_per_s": None if rate is None else round(rate),
                "round_trip_ms": None if latency is None else round(latency * 1e3, 3)}


def chunks_worth_loading(chunk_reads: Sequence[Mapping[str, int]],
                         speeds: Mapping[str, TierSpeed],
                         compute_seconds_per_chunk: float) -> int:
    """How many leading chunks to load: the longest prefix whose expected load time is at
    most the time the engine would take to compute it. `chunk_reads` gives, per chunk,
    the bytes each tier would have to read for it (empty: already in CPU memory, free).
    Tiers are read one after another, so their times add up; a tier never measured costs
    nothing (it is assumed to pay off)."""
    costs: dict[str, tuple[float, float] | None] = {}  # each tier's figures, read once
    best = 0
    pending: dict[str, int] = {}
    for count, reads in enumerate(chunk_reads, start=1):
        for tier, nbytes in reads.items():
            pending[tier] = pending.get(tier, 0) + nbytes
            if tier not in costs:
                costs[tier] = speeds[tier].read_cost()
        load = 0.0
        for tier, nbytes in pending.items():
            cost = costs[tier]
            if cost is not None:
                load += cost[0] + nbytes / cost[1]
        if load <= count * compute_seconds_per_chunk:
            best = count
    return best
