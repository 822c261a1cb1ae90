"""How fast this engine prefills, measured from the scheduler's own steps.

vLLM's scheduler builds the connector's metadata once per step, just before the step is
queued. Scheduling synchronously, it queues one step at a time: the next is built as soon
as this one's output is in, so the gap between two builds is the earlier step's time.
Scheduling asynchronously (vLLM's default on GPUs) it keeps two steps queued: the second
is built at once, without waiting, and each later one as soon as the oldest queued step's
output is in, so the gap between two builds is the time of the step built two before the
later one (the GPU ran it while the other waited behind it). A step that computed many
tokens and loaded nothing from kvdepot gives a prefill rate. A gap is used only when the
later step goes on with a request of the measured one: otherwise the engine may have sat
idle in between, waiting for work.

The rate travels with every lookup, so the server reads from its disk and shared tiers
only what loads faster than this engine computes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

SMOOTHING = 0.3
"""Weight of the newest step in the moving average: batch mixes change from step to
step, so one step is noisy, and a few follow a change of load."""


@dataclass(slots=True)
class _Step:
    at: float
    tokens: int
    request_ids: frozenset[str]
    loaded: bool


class PrefillRate:
    def __init__(self, min_tokens: int, steps_in_flight: int = 1) -> None:
        """`min_tokens`: steps that computed fewer tokens are mostly decode and left out
        (a decode token costs far less than a prefill token). `steps_in_flight`: how many
        steps vLLM keeps queued (`steps_in_flight` below)."""
        self.min_tokens = min_tokens
        self._steps_in_flight = steps_in_flight
        self._recent: deque[_Step] = deque(maxlen=steps_in_flight)
        self._rate: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """The moving average; None until a step has been measured."""
        return self._rate

    def step(self, tokens: int, request_ids: frozenset[str], loaded: bool,
             now: float | None = None) -> None:
        """A step is about to run: `tokens` scheduled for `request_ids`; `loaded`: it
        reads KV from kvdepot (its time is then not compute alone)."""
        now = time.monotonic() if now is None else now
        recent = self._recent
        if len(recent) == self._steps_in_flight:
            measured, previous = recent[0], recent[-1]  # built `steps_in_flight` before
            if (not measured.loaded and measured.tokens >= self.min_tokens
                    and now > previous.at and not measured.request_ids.isdisjoint(request_ids)):
                sample = measured.tokens / (now - previous.at)
                self._rate = sample if self._rate is None else (
                    self._rate + SMOOTHING * (sample - self._rate))
        recent.append(_Step(now, tokens, request_ids, loaded))

    def finished(self, request_id: str, completed: bool, now: float | None = None) -> None:
        """A request ended; `completed`: at the output of its last step (not aborted).

        Until a step has been measured, a request whose last step was a busy one (its
        prefill: it asked for one token) gives a first rate: that step's tokens over the
        time from its build to this output. Steps queued ahead of it count in that time,
        so the rate is never above the engine's, and loads weighed against it look no
        better than while nothing is measured (when every load is taken). Without it an
        engine whose every request ends with its prefill would never have a rate."""
        if self._rate is not None or not completed:
            return
        now = time.monotonic() if now is None else now
        last = next((step for step in reversed(self._recent)
                     if request_id in step.request_ids), None)
        if (last is not None and not last.loaded and last.tokens >= self.min_tokens
                and now > last.at):
            self._rate = last.tokens / (now - last.at)


def steps_in_flight(async_scheduling: bool) -> int:
    """How many steps vLLM keeps queued (its engine's batch queue, one pipeline stage):
    two when it schedules asynchronously, else one."""
    return 2 if async_scheduling else 1
