"""The first kvdepot hit in `kvdepot bench e2e --device cuda`, the part that needs no GPU:
the report splits it as vLLM times it (kvdepot's wait for the lookup and load, then the step)
and sets vLLM's own hit of the same prompt beside it, first against later, so that a host
whose pace shifted during the first prompt shows in the same line as the ratio."""

from __future__ import annotations

import pytest

from kvdepot.bench import e2e_gpu


def _row(hit_ms: float, wait_ms: float, step_ms: float, own_hit_ms: float,
         retrieve_ms: float | None = None) -> dict[str, object]:
    phases = {"waiting_ms": wait_ms, "running_ms": step_ms}
    if retrieve_ms is not None:
        phases["server_retrieve_ms"] = retrieve_ms
    return {"cold": 0.2, "vllm_hit": own_hit_ms / 1e3, "vllm_hit_same": True,
            "hit": hit_ms / 1e3, "hit_same": True, "hit_cached_tokens": 8191, "loaded": 8191,
            "hit_phases": phases}


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


def test_a_staged_hits_retrieve_shows_inside_its_step(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """A staged load waits inside the scheduler's step, so vLLM's split shows no wait: the
    server's time on the retrieve, beside it, says where the load went."""
    kvdepot = [_row(47.2, 0.02, 42.5, 30.3, 21.3), _row(43.4, 0.02, 39.3, 27.2, 21.6),
               _row(48.0, 0.02, 43.9, 20.3, 21.1)]
    results = {"kvdepot": {"ttft": {8192: kvdepot}}}
    line = e2e_gpu._report(results, 50e9, 131072, [8192])["lengths"][8192]
    assert (line["kvdepot_first_retrieve_ms"], line["kvdepot_later_retrieves_ms"]) == (
        21.3, pytest.approx(21.35))
    assert ("its step 42.5, later ones 41.6; the server's retrieve 21.3, later ones 21.4; "
            "vLLM's own hit") in capsys.readouterr().out


def test_the_floor_is_also_read_from_every_own_hit_of_the_no_connector_engine(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The H100 run of 2026-12-07 06:41: the table's floor takes the three own hits timed
    right after the cold runs (17.4, 16.1, 33.2 ms), the second reading all six."""
    none = [{"cold": 0.21, "vllm_hit": a / 1e3, "vllm_hit_settled": b / 1e3,
             "vllm_hit_same": True} for a, b in ((17.4, 16.8), (16.1, 13.8), (33.2, 13.5))]
    kvdepot = [_row(39.0, 0.01, 36.3, 18.0, 21.2), _row(37.8, 0.01, 35.0, 17.4, 20.9),
               _row(37.7, 0.01, 35.1, 17.4, 20.9)]
    results = {"none": {"ttft": {8192: none}}, "kvdepot": {"ttft": {8192: kvdepot}}}
    line = e2e_gpu._report(results, 54.2e9, 131072, [8192])["lengths"][8192]
    bytes_ms = 8192 * 131072 / 54.2e9 * 1e3
    assert line["floor"] == pytest.approx(17.4 + bytes_ms)
    assert line["floor_every_own_hit"] == pytest.approx((16.1 + 16.8) / 2 + bytes_ms)
    assert ("the floor from every own hit of the no-connector engine (after each cold run "
            "and again later): 8192: 36.3 ms, kvdepot 1.04x") in capsys.readouterr().out


def test_the_floor_is_also_read_from_the_kvdepot_engines_own_hits(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The H100 run of 2026-12-07 10:03, its first three 8,192-token prompts: the kvdepot
    engine's own hits (right after each cold run and once its stores were done) set the
    third floor, so the no-connector engine's pace, minutes earlier, does not enter it."""
    kvdepot = [{**_row(hit, 0.01, 38.0, own), "vllm_hit_settled": settled / 1e3}
               for hit, own, settled in ((45.0, 25.9, 23.9), (44.4, 20.9, 18.6),
                                         (41.8, 20.3, 17.5))]
    none = [{"cold": 0.22, "vllm_hit": 0.0239, "vllm_hit_same": True}]
    results = {"none": {"ttft": {8192: none}}, "kvdepot": {"ttft": {8192: kvdepot}}}
    line = e2e_gpu._report(results, 55.4e9, 131072, [8192])["lengths"][8192]
    bytes_ms = 8192 * 131072 / 55.4e9 * 1e3
    assert line["floor_kvdepot_engine"] == pytest.approx((20.3 + 20.9) / 2 + bytes_ms)
    assert line["floor"] == pytest.approx(23.9 + bytes_ms)  # the table's stays the same
    assert ("the floor from the kvdepot engine's own hits of the same prompts: 8192: 40.0 ms, "
            "kvdepot 1.11x") in capsys.readouterr().out


def test_without_a_kvdepot_engine_there_is_no_third_floor(
        capsys: pytest.CaptureFixture[str]) -> None:
    none = [{"cold": 0.22, "vllm_hit": 0.0239, "vllm_hit_same": True}]
    line = e2e_gpu._report({"none": {"ttft": {8192: none}}}, 55.4e9, 131072,
                           [8192])["lengths"][8192]
    assert "floor_kvdepot_engine" not in line
    assert "kvdepot engine's own hits" not in capsys.readouterr().out
