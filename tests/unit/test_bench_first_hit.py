"""The first kvdepot hit in `kvdepot bench e2e --device cuda`, the part that needs no GPU:
the report splits it as vLLM times it (kvdepot's wait for the lookup and load, then the step)
and sets vLLM's own hit of the same prompt beside it, first against later, so that a host
whose pace shifted during the first prompt shows in the same line as the ratio."""

from __future__ import annotations

import pytest

from kvdepot.bench import e2e_gpu


def _row(hit_ms: float, wait_ms: float, step_ms: float, own_hit_ms: float
         ) -> dict[str, object]:
    return {"cold": 0.2, "vllm_hit": own_hit_ms / 1e3, "vllm_hit_same": True,
            "hit": hit_ms / 1e3, "hit_same": True, "hit_cached_tokens": 8191, "loaded": 8191,
            "hit_phases": {"waiting_ms": wait_ms, "running_ms": step_ms}}


def test_the_first_hit_line_splits_the_hit_and_shows_the_engines_pace(
        capsys: pytest.CaptureFixture[str]) -> None:
    kvdepot = [_row(61.5, 28.1, 30.5, 32.9), _row(45.1, 27.1, 15.1, 19.3),
               _row(45.0, 27.2, 14.3, 18.9)]
    results = {"kvdepot": {"ttft": {8192: kvdepot}}}
    line = e2e_gpu._report(results, 50e9, 131072, [8192])["lengths"][8192]
    assert (line["kvdepot_first_load_ms"], line["kvdepot_later_loads_ms"]) == (28.1, 27.15)
    assert (line["kvdepot_first_step_ms"], line["kvdepot_later_steps_ms"]) == (30.5, 14.7)
    assert line["vllm_hit_before_first_with_kvdepot"] == pytest.approx(32.9)
    assert line["vllm_hit_before_later_with_kvdepot"] == pytest.approx(19.1)
    out = capsys.readouterr().out
    assert ("first kvdepot hit at 8192 tokens: 61.5 ms, later ones 45.0 (1.37x); its wait "
            "for the lookup and load 28.1 ms, later ones 27.1; its step 30.5, later ones "
            "14.7; vLLM's own hit of the same prompt before it 32.9, later ones 19.1 (the "
            "engine's pace)") in out
