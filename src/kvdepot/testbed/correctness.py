"""The end-to-end correctness check, with its control, for `kvdepot demo` and `bench e2e`.

One probe prompt runs in the same engine three ways: cold (computed from scratch),
again at once (a hit in vLLM's own prefix cache), and after vLLM's prefix cache was
emptied (its KV loaded from kvdepot). A fourth run, another prompt of the same length,
is the control: it shows that the comparison tells different KV apart. Each run's
greedy tokens and top logprobs are compared with the cold run's. vLLM's own hit is the
honest tolerance: it differs from the cold run only by the rounding of computing the
prompt's tail on its own, which is exactly what a correct kvdepot hit does too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdepot.client.scheduler import MIN_TAIL_TOKENS
from kvdepot.testbed.vllm_engine import Completion, request_counting_loads

if TYPE_CHECKING:
    from kvdepot.client.admin import AdminClient

OUTPUT_TOKENS = 16
TOP_LOGPROBS = 5
# float32 rounding: the tolerance when vLLM's own hit happens to match the cold run exactly.
ROUNDING_FLOOR = 1e-5
# The control must differ by far more than the tolerance, or the check proves nothing.
CONTROL_MARGIN = 100.0

# ask(name, prompt, evict_first) -> (completion with top logprobs, tokens loaded from
# kvdepot); evict_first empties vLLM's prefix cache before the request.
Ask = Callable[[str, list[int], bool], tuple[Completion, int]]


@dataclass
class Comparison:
    differing_tokens: int
    logprob_difference: float

    def describe(self) -> str:
        return (f"{self.differing_tokens:>2} of {OUTPUT_TOKENS} tokens differ, largest logprob "
                f"difference {self.logprob_difference:.2g}")


def compare(run: Completion, reference: Completion) -> Comparison:
    """Greedy tokens that differ, and the largest |difference| of the top logprobs by rank."""
    differing = sum(a != b for a, b in zip(run.token_ids, reference.token_ids, strict=True))
    largest = max((abs(a - b)
                   for step_a, step_b in zip(run.top_logprobs, reference.top_logprobs,
                                             strict=True)
                   for a, b in zip(step_a, step_b, strict=True)), default=0.0)
    return Comparison(differing, largest)


@dataclass
class CorrectnessReport:
    prompt_tokens: int
    expected_loaded: int
    loaded: int
    control: Comparison
    vllm_hit: Comparison
    kvdepot_hit: Comparison
    against_vllm_hit: Comparison | None = None
    """The kvdepot hit against vLLM's own hit: set in half precision (`exact`), where
    rounding makes every hit drift from the cold run within a few greedy tokens, but the
    two hits compute the probe's last token alike on the same KV, so must agree bit for
    bit."""

    @property
    def tolerance(self) -> float:
        return max(self.vllm_hit.logprob_difference, ROUNDING_FLOOR)

    def failures(self) -> list[str]:
        """Every check that failed, in words; empty when all passed."""
        if self.against_vllm_hit is not None:
            return self._exact_failures(self.against_vllm_hit)
        failed = []
        control = self.control
        if control.differing_tokens == 0 or (
                control.logprob_difference <= CONTROL_MARGIN * self.tolerance):
            failed.append("the control failed: another prompt gives (nearly) the same output, "
                          "so this model cannot tell right KV from wrong")
        if self.loaded != self.expected_loaded:
            failed.append(f"the kvdepot hit loaded {self.loaded} tokens, expected "
                          f"{self.expected_loaded}")
        if self.kvdepot_hit.differing_tokens:
            failed.append(f"after loading from kvdepot {self.kvdepot_hit.differing_tokens} "
                          "greedy tokens differ from the cold run's")
        if self.kvdepot_hit.logprob_difference > self.tolerance:
            failed.append(f"the kvdepot hit's logprobs differ from the cold run's by "
                          f"{self.kvdepot_hit.logprob_difference:.2g}, more than the "
                          f"tolerance {self.tolerance:.2g}")
        return failed

    def _exact_failures(self, against: Comparison) -> list[str]:
        failed = []
        if (self.control.differing_tokens == 0
                or self.control.logprob_difference <= CONTROL_MARGIN * ROUNDING_FLOOR):
            failed.append("the control failed: another prompt gives the same output, so this "
                          "model cannot tell right KV from wrong")
        if self.loaded != self.expected_loaded:
            failed.append(f"the kvdepot hit loaded {self.loaded} tokens, expected "
                          f"{self.expected_loaded}")
        if against.differing_tokens or against.logprob_difference > ROUNDING_FLOOR:
            failed.append(f"the kvdepot hit differs from vLLM's own hit ({against.describe()}), "
                          "which computes the same last token on the same KV")
        return failed

    def lines(self) -> list[str]:
        verdict = self.failures()
        exact = self.against_vllm_hit
        rows = [("control: another prompt, cold", self.control, ""),
                ("hit in vLLM's own prefix cache", self.vllm_hit,
                 " (rounding)" if exact else " (the tolerance)"),
                (f"hit in kvdepot, {self.loaded} tokens loaded", self.kvdepot_hit, "")]
        if exact is not None:
            rows.append(("hit in kvdepot against vLLM's own", exact, " (must be 0)"))
        passed = ("PASS: the control differs, and the kvdepot hit is vLLM's own hit bit for "
                  "bit" if exact else "PASS: the control differs, and the kvdepot hit matches "
                  "the cold run as closely as vLLM's own hit does")
        return [
            f"correctness: a {self.prompt_tokens}-token prompt, {OUTPUT_TOKENS} greedy tokens "
            f"and their top-{TOP_LOGPROBS} logprobs, each run against the cold run:",
            *(f"  {label:<36}{comparison.describe()}{note}" for label, comparison, note in rows),
            "verdict: " + (passed if not verdict else "FAIL: " + "; ".join(verdict)),
        ]


def probe_length(chunk_size: int, chunks: int) -> int:
    """A prompt of `chunks` full chunks and a partial one, which is loaded as a tail (at
    least `MIN_TAIL_TOKENS`) when the connector keeps tails, else computed."""
    return chunks * chunk_size + 17


def engine_ask(llm: Any, admin: AdminClient) -> Ask:
    """The check's requests, sent to a vLLM engine whose connector uses `admin`'s server."""
    def ask(name: str, prompt: list[int], evict_first: bool) -> tuple[Completion, int]:
        _, completion, loaded = request_counting_loads(
            llm, admin, prompt, OUTPUT_TOKENS, evict_first, TOP_LOGPROBS)
        return completion, loaded

    return ask


def check_correctness(ask: Ask, probe: list[int], control: list[int], chunk_size: int,
                      tails: bool = True, exact: bool = False) -> CorrectnessReport:
    """Run the probe cold, as a vLLM hit, as a kvdepot hit, and the control cold.

    The probe and the control must be prompts nothing has cached yet. `tails`: the
    connector keeps tails, so the hit loads all but the probe's last token. `exact`
    (half precision): the kvdepot hit is held to vLLM's own hit bit for bit (see
    `CorrectnessReport.against_vllm_hit`), the probe ending one token past a block so
    that both compute just that token.
    """
    cold, _ = ask("cold", probe, True)
    vllm_hit, _ = ask("vLLM hit", probe, False)
    kvdepot_hit, loaded = ask("kvdepot hit", probe, True)
    other, _ = ask("control", control, True)
    return CorrectnessReport(
        prompt_tokens=len(probe),
        expected_loaded=(len(probe) - 1 if tails and len(probe) % chunk_size >= MIN_TAIL_TOKENS
                         else len(probe) // chunk_size * chunk_size),
        loaded=loaded, control=compare(other, cold), vllm_hit=compare(vllm_hit, cold),
        kvdepot_hit=compare(kvdepot_hit, cold),
        against_vllm_hit=compare(kvdepot_hit, vllm_hit) if exact else None)
