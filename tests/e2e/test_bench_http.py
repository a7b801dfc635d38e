"""The HTTP benchmark: its configuration specs, its report, and one quick run against real servers."""

from __future__ import annotations

import json

import pytest

from ferrox_batch.bench.http import main, named_configs, report


def test_configs_are_named_flag_lists():
    assert named_configs(["defaults=", "fast=--max-batch-tokens 2048 --step-target-ms 0"]) == [
        ("defaults", []), ("fast", ["--max-batch-tokens", "2048", "--step-target-ms", "0"])]
    with pytest.raises(SystemExit, match="NAME=FLAGS"):
        named_configs(["no-equals-sign"])


def test_the_report_gives_medians_and_throughput_over_the_first_config():
    runs = [{"config": "a", "tok_s": t, "ttft_p50_ms": 1, "ttft_p99_ms": 2, "itl_p50_ms": 3, "itl_p99_ms": 4}
            for t in (90, 100, 110)]
    runs += [{"config": "b", "tok_s": t, "ttft_p50_ms": 1, "ttft_p99_ms": 2, "itl_p50_ms": 3, "itl_p99_ms": 4}
             for t in (45, 50)] + [{"config": "b", "failed": "exit 1"}]
    lines = report(["a", "b"], runs)
    assert lines[2].startswith("| a | 100.0 |") and lines[2].endswith("| 1.00 |")
    assert lines[3].startswith("| b | 47.5 |") and lines[3].endswith("| 0.47 |")


@pytest.mark.slow
def test_a_quick_run_serves_every_request_from_each_config(tiny_batch_dir, tmp_path, capsys):
    out = tmp_path / "http.json"
    code = main(["--model", str(tiny_batch_dir), "--quick", "--dtype", "fp32", "--config", "defaults=",
                 "--config", "nocap=--step-target-ms 0", "--json", str(out)], {})
    assert code == 0, capsys.readouterr()
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"] for r in runs] == ["defaults", "nocap"]
    assert all(r["tokens"] == 4 * 8 and not r["errors"] and r["tok_s"] > 0 for r in runs)
    printed = capsys.readouterr().out
    assert "# cpu: " in printed and "| nocap |" in printed
