"""`kvdepot bench workload` runs end to end with small settings and reports what it says."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

# 1 GiB of server memory: the default 8 GiB, populated at start, was what the kernel's
# OOM killer took while the rest of the suite ran beside it.
SMALL = ["--model", "small", "--l1-size", "1GiB", "--documents", "3",
         "--document-tokens", "512", "--questions", "2",
         "--question-tokens", "32", "--answer-tokens", "4", "--users", "2",
         "--chat-context-tokens", "256", "--rounds", "2", "--user-tokens", "32",
         "--reply-tokens", "4", "--unique-prompts", "4", "--unique-tokens", "256",
         "--unique-output", "4"]
ENGINES = ("no connector", "kvdepot")
SCENARIOS = ("qa_warmup", "qa", "chat", "no_reuse")


def test_workload_bench_reports_both_engines_and_loads_from_kvdepot(tmp_path: Path) -> None:
    report_path, chart = tmp_path / "report.json", tmp_path / "ttft.png"
    done = subprocess.run(
        [sys.executable, "-m", "kvdepot.cli", "bench", "workload", *SMALL,
         "--json", str(report_path), "--plot", str(chart)],
        capture_output=True, text=True, timeout=1400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(report_path.read_text())

    for engine in ENGINES:
        for scenario in SCENARIOS:
            records = report["engines"][engine][scenario]["records"]
            assert records and all(r["ttft"] > 0 and r["end"] >= r["start"] + r["ttft"]
                                   for r in records)
            summary = report["summary"][engine][scenario]
            assert summary["requests"] == len(records)
            assert 0 < summary["ttft_p50_ms"] <= summary["ttft_p90_ms"]
            assert summary["output_tokens_per_s"] > 0
    assert len(report["engines"]["kvdepot"]["qa"]["records"]) == 3 * 2
    assert report["summary"]["kvdepot"]["qa"]["kvdepot_share"] > 0
    assert all(report["summary"]["no connector"][s]["kvdepot_share"] == 0 for s in SCENARIOS)
    assert report["engines"]["kvdepot"]["qa"]["kvdepot_sent_tokens"] > 0
    assert report["checks"] and all(c["passed"] for c in report["checks"]), report["checks"]
    assert {g["goal"].split(":")[0] for g in report["goals"]} == {"long-document QA",
                                                                  "no reuse"}
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for line in ("| long-document QA | no connector |", "| multi-round chat | no connector |",
                 "PASS  kvdepot engine: greedy tokens identical"):
        assert line in done.stdout
