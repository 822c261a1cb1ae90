"""vLLM's own hit in `kvdepot bench e2e --device cuda`, the parts that need no GPU: the
`noop` engine's connector does nothing; which engines time the own hit again once stores
are done, and in what order each engine's requests run; the report sets the own hit with a
connector doing nothing beside the one without a connector and with kvdepot."""

from __future__ import annotations

import pytest

from kvdepot.bench import e2e_gpu


def _rows(running_ms: float, settled_ms: float | None = None) -> list[dict[str, object]]:
    row: dict[str, object] = {
        "cold": 0.5, "vllm_hit": 0.05, "vllm_hit_same": True, "hit": 0.1,
        "hit_same": True, "hit_cached_tokens": 2047, "loaded": 2047,
        "vllm_hit_phases": {"waiting_ms": 0.0, "running_ms": running_ms}}
    if settled_ms is not None:
        row["vllm_hit_settled"] = settled_ms / 1e3 + 0.002
        row["vllm_hit_settled_phases"] = {"waiting_ms": 0.0, "running_ms": settled_ms}
    return [row]


def test_the_report_sets_each_engines_own_hit_step_side_by_side(
        capsys: pytest.CaptureFixture[str]) -> None:
    results = {"none": {"ttft": {2048: _rows(14.4)}}, "noop": {"ttft": {2048: _rows(14.1)}},
               "kvdepot": {"ttft": {2048: _rows(19.7)}}}
    summary = e2e_gpu._report(results, 50e9, 131072, [2048])
    line = summary["lengths"][2048]
    assert (line["running_ms"], line["running_ms_with_noop"],
            line["running_ms_with_kvdepot"]) == (14.4, 14.1, 19.7)
    out = capsys.readouterr().out
    assert ("its step (median ms): no connector 14.4, a connector doing nothing 14.1, "
            "kvdepot 19.7") in out
    assert "once stores are done" not in out  # runs saved before it was timed


def test_the_report_sets_the_own_hit_once_stores_are_done_beside_the_one_right_after(
        capsys: pytest.CaptureFixture[str]) -> None:
    results = {"none": {"ttft": {2048: _rows(14.4, settled_ms=14.2)}},
               "kvdepot": {"ttft": {2048: _rows(16.0, settled_ms=14.3)}}}
    line = e2e_gpu._report(results, 50e9, 131072, [2048])["lengths"][2048]
    assert (line["running_ms_settled"], line["running_ms_settled_with_kvdepot"]) == (14.2, 14.3)
    assert line["vllm_hit_settled"] == pytest.approx(16.2)
    assert ("vLLM's own hit at 2048 tokens once stores are done (median ms): no connector "
            "16.2, kvdepot 16.3; its step 14.2 and 14.3") in capsys.readouterr().out


def test_the_settled_own_hit_with_a_connector_doing_nothing_is_set_beside_kvdepots(
        capsys: pytest.CaptureFixture[str]) -> None:
    """What vLLM's connector plumbing alone costs, in the figure kvdepot's is read from."""
    results = {"none": {"ttft": {2048: _rows(14.4, settled_ms=14.2)}},
               "noop": {"ttft": {2048: _rows(14.9, settled_ms=15.0)}},
               "kvdepot": {"ttft": {2048: _rows(16.0, settled_ms=15.1)}}}
    line = e2e_gpu._report(results, 50e9, 131072, [2048])["lengths"][2048]
    assert line["vllm_hit_settled_with_noop"] == pytest.approx(17.0)
    assert ("once stores are done (median ms): no connector 16.2, kvdepot 17.1, a connector "
            "doing nothing 17.0; its step 14.2 and 15.1") in capsys.readouterr().out


def test_the_noop_connector_never_hits_loads_or_stores() -> None:
    pytest.importorskip("vllm")
    from kvdepot.bench.noop_connector import NoopConnector

    assert "noop" in e2e_gpu.ENGINES
    assert not NoopConnector.__abstractmethods__  # vLLM can build it
    connector = NoopConnector.__new__(NoopConnector)  # no vLLM config needed for these
    assert connector.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert connector.build_connector_meta(object()) is not None


def test_the_settled_own_hit_is_the_median_of_its_runs(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    # One slow run on a busy host (the 90 ms one) does not move the figure kept.
    runs = iter([(0.090, {"waiting_ms": 0.2, "running_ms": 80.0}),
                 (0.020, {"waiting_ms": 0.1, "running_ms": 16.0}),
                 (0.019, {"waiting_ms": 0.1, "running_ms": 15.0}),
                 (0.021, {"running_ms": 17.0}),
                 (0.018, {"waiting_ms": 0.3, "running_ms": 15.5})])
    monkeypatch.setattr(e2e_gpu, "_timed", lambda llm, prompt: (*next(runs), 7, 2047))
    wall, phases = e2e_gpu._timed_median(None, [1, 2, 3], 5)
    assert wall == 0.020
    # A phase some run did not report is left out rather than taken from fewer runs.
    assert phases == {"running_ms": 16.0}


def _record_measurements(monkeypatch: pytest.MonkeyPatch, engine: str) -> list[str]:
    """What `_measure_prompt` does to the engine, in order (an `LLM` stands in by name)."""
    steps: list[str] = []
    monkeypatch.setattr(e2e_gpu, "_evict", lambda llm: steps.append("evict"))
    monkeypatch.setattr(e2e_gpu, "_let_stores_finish", lambda admin: steps.append("settle"))
    monkeypatch.setattr(e2e_gpu, "_timed", lambda llm, prompt: (
        steps.append("request") or (0.02, {"running_ms": 16.0}, 7, len(prompt) - 1)))
    row = e2e_gpu._measure_prompt("llm", engine, [1, 2, 3], None)
    steps.append(",".join(sorted(row)))
    return steps


@pytest.mark.parametrize("engine", ["none", "noop", "kvdepot", "kvdepot-async"])
def test_the_engines_compared_on_their_own_hit_time_it_again_once_stores_are_done(
        monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    steps = _record_measurements(monkeypatch, engine)
    settled = ["settle"] + ["request"] * e2e_gpu.SETTLED_REPEATS
    hit = ["evict", "request"] if engine.startswith("kvdepot") else []
    assert steps[:-1] == ["evict", "request", "request", *settled, *hit]
    assert "vllm_hit_settled" in steps[-1]


@pytest.mark.parametrize("engine", ["offload", "lmcache"])
def test_a_peer_goes_from_its_own_hit_straight_to_its_hit(
        monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    """LMCache 0.5.6's load on vLLM's own hit of a prompt it holds failed on the GPU, and its
    hits then loaded nothing: the peers' hits are not measured after such own hits."""
    steps = _record_measurements(monkeypatch, engine)
    assert steps[:-1] == ["evict", "request", "request", "evict", "request"]
    assert "vllm_hit_settled" not in steps[-1] and "hit_cached_tokens" in steps[-1]


def test_the_first_token_line_names_only_engines_that_had_hits(
        capsys: pytest.CaptureFixture[str]) -> None:
    noop_rows = _rows(14.1)
    for row in noop_rows:  # what the noop engine records: no hit of its own
        del row["hit"], row["hit_same"]
    results = {"none": {"ttft": {2048: _rows(14.4)}}, "noop": {"ttft": {2048: noop_rows}},
               "kvdepot": {"ttft": {2048: _rows(19.7)}}}
    e2e_gpu._report(results, 50e9, 131072, [2048])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("first token"))
    assert "kvdepot hits 1 of 1" in line and "noop" not in line


def test_throughput_with_a_connector_doing_nothing_is_set_beside_kvdepots(
        capsys: pytest.CaptureFixture[str]) -> None:
    """What vLLM's connector plumbing alone costs a batch without reuse, in the same run."""
    results = {"none": {"ttft": {2048: _rows(14.4)}, "throughput": [40000.0, 39000.0]},
               "noop": {"ttft": {2048: _rows(14.1)}, "throughput": [39000.0, 39200.0]},
               "kvdepot": {"ttft": {2048: _rows(19.7)}, "throughput": [39100.0, 38900.0]}}
    summary = e2e_gpu._report(results, 50e9, 131072, [2048])
    assert summary["throughput_ratio"] == pytest.approx(39000 / 39500)
    out = capsys.readouterr().out
    assert "kvdepot / no connector: 0.987" in out
    assert ("the others' / no connector: a connector doing nothing 0.990; every batch's "
            "tokens/s: none 40000, 39000; noop 39000, 39200; kvdepot 39100, 38900") in out
