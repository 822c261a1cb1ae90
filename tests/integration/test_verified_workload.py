"""The verifying workload behind the chaos test and the soak behaves like an engine: it
cleans up every lookup result once its request is over, so its memory stays flat."""

from __future__ import annotations


def test_the_workload_keeps_no_lookup_result_of_a_finished_request(engines):
    engine = engines()
    counts = engine.workload_run(1.0, 5)
    assert counts["lookups"] > 0
    assert engine.lookup_results_held() == 0
