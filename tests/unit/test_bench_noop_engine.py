"""The `noop` engine of `kvdepot bench e2e --device cuda`, the parts that need no GPU: the
connector vLLM would load for it does nothing, and the report sets vLLM's own hit's step
with it beside the step without a connector and with kvdepot."""

from __future__ import annotations

import pytest

from kvdepot.bench import e2e_gpu


def _rows(running_ms: float) -> list[dict[str, object]]:
    return [{"cold": 0.5, "vllm_hit": 0.05, "vllm_hit_same": True, "hit": 0.1,
             "hit_same": True, "hit_cached_tokens": 2047, "loaded": 2047,
             "vllm_hit_phases": {"waiting_ms": 0.0, "running_ms": running_ms}}]


def test_the_report_sets_each_engines_own_hit_step_side_by_side(
        capsys: pytest.CaptureFixture[str]) -> None:
    results = {"none": {"ttft": {2048: _rows(14.4)}}, "noop": {"ttft": {2048: _rows(14.1)}},
               "kvdepot": {"ttft": {2048: _rows(19.7)}}}
    summary = e2e_gpu._report(results, 50e9, 131072, [2048])
    line = summary["lengths"][2048]
    assert (line["running_ms"], line["running_ms_with_noop"],
            line["running_ms_with_kvdepot"]) == (14.4, 14.1, 19.7)
    assert ("its step (median ms): no connector 14.4, a connector doing nothing 14.1, "
            "kvdepot 19.7") in capsys.readouterr().out


def test_the_noop_connector_never_hits_loads_or_stores() -> None:
    pytest.importorskip("vllm")
    from kvdepot.bench.noop_connector import NoopConnector

    assert "noop" in e2e_gpu.ENGINES
    assert not NoopConnector.__abstractmethods__  # vLLM can build it
    connector = NoopConnector.__new__(NoopConnector)  # no vLLM config needed for these
    assert connector.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert connector.build_connector_meta(object()) is not None
