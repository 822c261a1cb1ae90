"""How long this engine waits for a load from kvdepot, measured by the scheduler.

A load is planned when vLLM allocates the request's blocks and done when the worker
reports it received; the request waits in between. The wait has a fixed part (the
round trips through the worker, the server and the copy, and the engine steps that
carry the news) and a part that grows with the tokens loaded. A straight line fitted
to recent loads gives both; the scheduler compares the line with what computing the
same tokens would take (`PrefillRate`) and loads only what arrives sooner.
"""

from __future__ import annotations

import time
from collections import deque

PRIOR_FIXED_S = 2e-3
"""The fixed part assumed before any load was timed: a load costs at least the server's
round trips and two engine steps (one carries the load out, the next the news back)."""
SAMPLES = 32
"""Recent loads the line is fitted to: enough to smooth the step jitter, few enough to
follow a change of load on the engine or the server."""


class LoadTime:
    def __init__(self) -> None:
        self._planned: dict[str, tuple[float, int]] = {}
        self._samples: deque[tuple[int, float]] = deque(maxlen=SAMPLES)

    def planned(self, request_id: str, tokens: int, now: float | None = None) -> None:
        """A load of `tokens` was planned for `request_id`."""
        self._planned[request_id] = (time.monotonic() if now is None else now, tokens)

    def received(self, request_id: str, now: float | None = None) -> None:
        """The worker reported `request_id`'s load done (whether it worked or not)."""
        started = self._planned.pop(request_id, None)
        if started is None:
            return
        at, tokens = started
        self._samples.append((tokens, max(0.0, (time.monotonic() if now is None else now)
                                          - at)))

    def forget(self, request_id: str) -> None:
        self._planned.pop(request_id, None)

    @property
    def pending(self) -> bool:
        """Whether a planned load is not yet reported received (nor forgotten)."""
        return bool(self._planned)

    def estimate(self, tokens: int) -> float:
        """Seconds a request waits for a load of `tokens`, from the fitted line."""
        fixed, per_token = self._line()
        return fixed + per_token * tokens

    def _line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token), both at least 0."""
        samples = self._samples
        if not samples:
            return PRIOR_FIXED_S, 0.0
        n = len(samples)
        mean_x = sum(x for x, _ in samples) / n
        mean_y = sum(y for _, y in samples) / n
        spread = sum((x - mean_x) ** 2 for x, _ in samples)
        if spread == 0:
            # Loads of one size only: all of the wait counts as fixed, which overstates
            # what a smaller load costs and so errs toward computing.
            return mean_y, 0.0
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in samples) / spread)
        return max(0.0, mean_y - slope * mean_x), slope


def load_pays(tokens: int, prefill_tokens_per_s: float | None, load: LoadTime) -> bool:
    """Whether loading `tokens` makes the request ready sooner than computing them.
    Unknown rates load (as before anything was measured)."""
    if tokens <= 0:
        return False
    if not prefill_tokens_per_s:
        return True
    return load.estimate(tokens) < tokens / prefill_tokens_per_s
