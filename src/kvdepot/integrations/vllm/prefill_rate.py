"""How fast this engine prefills, measured from the scheduler's own steps.

vLLM's scheduler builds the connector's metadata once per step, just before the step
runs, and the next step is built as soon as this one's output is in (while requests are
running). The time between two builds is therefore one step's time, and a step that
computed many tokens and loaded nothing from kvdepot gives a prefill rate. A gap is used
only when the next step goes on with a request of this one: otherwise the engine may
have sat idle in between, waiting for work.

The rate travels with every lookup, so the server reads from its disk and shared tiers
only what loads faster than this engine computes.
"""

from __future__ import annotations

import time
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
    def __init__(self, min_tokens: int) -> None:
        """`min_tokens`: steps that computed fewer tokens are mostly decode and left out
        (a decode token costs far less than a prefill token)."""
        self.min_tokens = min_tokens
        self._last: _Step | None = None
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
        last = self._last
        if (last is not None and not last.loaded and last.tokens >= self.min_tokens
                and now > last.at and not last.request_ids.isdisjoint(request_ids)):
            sample = last.tokens / (now - last.at)
            self._rate = sample if self._rate is None else (
                self._rate + SMOOTHING * (sample - self._rate))
        self._last = _Step(now, tokens, request_ids, loaded)
