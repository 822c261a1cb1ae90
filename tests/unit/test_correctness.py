"""The correctness verdict of the demo and `bench e2e`: each of its checks can fail."""

from kvdepot.testbed.correctness import (
    OUTPUT_TOKENS,
    Comparison,
    CorrectnessReport,
    check_correctness,
    compare,
)
from kvdepot.testbed.vllm_engine import Completion


def completion(first_token: int, shift: float = 0.0) -> Completion:
    return Completion([first_token, *range(1, OUTPUT_TOKENS)],
                      [[-0.5 + shift, -2.0, -3.0] for _ in range(OUTPUT_TOKENS)])


def test_compare_counts_differing_tokens_and_the_largest_logprob_difference() -> None:
    result = compare(completion(7, shift=0.25), completion(9))
    assert result == Comparison(differing_tokens=1, logprob_difference=0.25)
    assert compare(completion(9), completion(9)) == Comparison(0, 0.0)


def report(**changes: object) -> CorrectnessReport:
    fields: dict[str, object] = {
        "prompt_tokens": 1041, "expected_loaded": 1024, "loaded": 1024,
        "control": Comparison(12, 3.0), "vllm_hit": Comparison(0, 2e-6),
        "kvdepot_hit": Comparison(0, 2e-6)}
    return CorrectnessReport(**(fields | changes))  # type: ignore[arg-type]


def test_a_correct_hit_passes() -> None:
    assert report().failures() == []
    assert report().lines()[-1].startswith("verdict: PASS")


def test_each_check_fails_on_its_own() -> None:
    failing = {
        "control": report(control=Comparison(0, 3.0)),
        "control margin": report(control=Comparison(5, 1e-4)),
        "nothing loaded": report(loaded=0),
        "wrong tokens": report(kvdepot_hit=Comparison(1, 2e-6)),
        "logprobs off": report(kvdepot_hit=Comparison(0, 1e-3)),
    }
    for name, bad in failing.items():
        assert len(bad.failures()) == 1, name
        assert bad.lines()[-1].startswith("verdict: FAIL: "), name


def test_the_tolerance_is_vllms_own_hit_with_a_rounding_floor() -> None:
    assert report(vllm_hit=Comparison(0, 0.0)).tolerance == 1e-5
    assert report(vllm_hit=Comparison(0, 0.01), kvdepot_hit=Comparison(0, 0.009)
                  ).failures() == []


def test_check_runs_cold_vllm_hit_kvdepot_hit_then_control() -> None:
    calls = []

    def ask(name: str, prompt: list[int], evict_first: bool) -> tuple[Completion, int]:
        calls.append((name, prompt[0], evict_first))
        return completion(prompt[0]), 1040 if name == "kvdepot hit" else 0

    result = check_correctness(ask, [5] * 1041, [6] * 1041, 256)
    assert calls == [("cold", 5, True), ("vLLM hit", 5, False), ("kvdepot hit", 5, True),
                     ("control", 6, True)]
    # The 17 tokens past the last chunk are a tail: all but the last token is loaded.
    assert result.loaded == result.expected_loaded == 1040
    assert check_correctness(ask, [5] * 1041, [6] * 1041, 256, tails=False
                             ).expected_loaded == 1024
    # The stand-in "model" answers differently only in the first token: too little to
    # trust, so the control check fails.
    assert result.control == Comparison(1, 0.0)
    assert len(result.failures()) == 1


def test_in_half_precision_the_kvdepot_hit_must_be_vllms_own_hit_bit_for_bit() -> None:
    # bf16: both hits drift from the cold run alike; only their agreement counts.
    drifted = {"vllm_hit": Comparison(5, 1.7), "kvdepot_hit": Comparison(5, 1.7),
               "control": Comparison(16, 1.9)}
    assert report(**drifted, against_vllm_hit=Comparison(0, 0.0)).failures() == []
    assert report(**drifted, against_vllm_hit=Comparison(0, 0.0)).lines()[-1].startswith(
        "verdict: PASS")
    failing = {
        "differs from vLLM's hit": report(**drifted, against_vllm_hit=Comparison(1, 0.0)),
        "logprobs off": report(**drifted, against_vllm_hit=Comparison(0, 1e-3)),
        "control": report(**(drifted | {"control": Comparison(0, 0.0)}),
                          against_vllm_hit=Comparison(0, 0.0)),
        "nothing loaded": report(**drifted, loaded=0, against_vllm_hit=Comparison(0, 0.0)),
    }
    for name, bad in failing.items():
        assert len(bad.failures()) == 1, name
