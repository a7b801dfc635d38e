"""The HTTP benchmark: its configuration specs, its report, and one quick run against real servers."""

from __future__ import annotations

import json
import sys

import pytest

from ferrox_batch.bench.http import main, named_configs, report
from ferrox_batch.bench.servers import ServerSpec


def test_configs_are_named_flag_lists_then_peer_commands():
    assert named_configs(["defaults=", "fast=--max-batch-tokens 2048 --step-target-ms 0"],
                         ["llama=/opt/llama-server -m m.gguf --port {port}"]) == [
        ServerSpec("defaults"), ServerSpec("fast", ("--max-batch-tokens", "2048", "--step-target-ms", "0")),
        ServerSpec("llama", peer_command="/opt/llama-server -m m.gguf --port {port}")]
    with pytest.raises(SystemExit, match="NAME=FLAGS"):
        named_configs(["no-equals-sign"])
    with pytest.raises(SystemExit, match="NAME=COMMAND"):
        named_configs([], ["no-equals-sign"])
    with pytest.raises(SystemExit, match=r"\{port\}"):
        named_configs([], ["llama=/opt/llama-server --port 8080"])
    with pytest.raises(SystemExit, match="must differ"):
        named_configs(["a="], ["a=server --port {port}"])


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
    # The peer is our own server started from its command line: the path a llama.cpp server takes.
    peer = f"{sys.executable} -m ferrox_batch.cli serve --model {tiny_batch_dir} --dtype fp32 --port {{port}}"
    code = main(["--model", str(tiny_batch_dir), "--quick", "--dtype", "fp32", "--config", "defaults=",
                 "--config", "nocap=--step-target-ms 0", "--peer", f"peer={peer}", "--json", str(out)], {})
    assert code == 0, capsys.readouterr()
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"] for r in runs] == ["defaults", "nocap", "peer"]
    assert all(r["tokens"] == 4 * 8 and not r["errors"] and r["tok_s"] > 0 for r in runs)
    printed = capsys.readouterr().out
    assert "# cpu: " in printed and "| nocap |" in printed and "| peer |" in printed
