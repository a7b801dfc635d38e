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
    runs[1].update(worker_idle=0.01, worker_scheduling=0.02, worker_forward=0.97, worker_off_cpu=0.1)
    lines = report(["a", "b"], runs)
    assert lines[1].count("|") == lines[0].count("|")
    assert lines[2].startswith("| a | 100.0 |") and lines[2].endswith("| 1% / 2% / 97% (10%) | 1.00 |")
    assert lines[3].startswith("| b | 47.5 |") and lines[3].endswith("| - | 0.47 |")


def test_the_worker_split_is_each_time_over_the_run_and_none_for_a_server_without_it():
    from ferrox_batch.bench.http_client import worker_split

    before = {"worker_idle_ms": 100, "worker_scheduling_ms": 0, "worker_forward_ms": 1000, "worker_forward_off_cpu_ms": 0}
    after = {"worker_idle_ms": 300, "worker_scheduling_ms": 100, "worker_forward_ms": 2700,
             "worker_forward_off_cpu_ms": 200}
    assert worker_split(before, after, 2.0) == {"worker_idle": 0.1, "worker_scheduling": 0.05,
                                                "worker_forward": 0.85, "worker_off_cpu": 0.1}
    assert set(worker_split(None, after, 2.0).values()) == {None}
    assert set(worker_split({"decode_steps": 1}, after, 2.0).values()) == {None}


@pytest.mark.slow
def test_a_quick_run_serves_every_request_from_each_config(tiny_batch_dir, tmp_path, capsys):
    out = tmp_path / "http.json"
    # The peer is our own server started from its command line: the path a llama.cpp server takes.
    peer = f"{sys.executable} -m ferrox_batch.cli serve --model {tiny_batch_dir} --dtype fp32 --port {{port}}"
    code = main(["--model", str(tiny_batch_dir), "--quick", "--dtype", "fp32", "--config", "nocap=--step-target-ms 0",
                 "--peer", f"peer={peer}", "--json", str(out),
                 "--plot", str(tmp_path / "http.png")], {})
    assert code == 0, capsys.readouterr()
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"] for r in runs] == ["nocap", "peer"]
    assert (tmp_path / "http.png").read_bytes().startswith(b"\x89PNG")
    assert all(len(r["ttfts_ms"]) == 4 and len(r["itls_ms"]) == r["itl_count"] for r in runs)
    assert all(r["tokens"] == 4 * 8 and not r["errors"] and r["tok_s"] > 0 for r in runs)
    assert all(0 < r["worker_forward"] <= 1.01 for r in runs)  # our server (the peer too) reports its worker
    printed = capsys.readouterr().out
    assert "# cpu: " in printed and "| nocap |" in printed and "| peer |" in printed


def test_shape_d_sends_copying_tasks_one_at_a_time(tiny_batch_dir, tmp_path, capsys):
    out = tmp_path / "d.json"
    code = main(["--model", str(tiny_batch_dir), "--quick", "--dtype", "fp32", "--shape", "d", "--config", "spec=",
                 "--config", "nospec=--no-speculative", "--json", str(out)], {})
    assert code == 0, capsys.readouterr()
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"] for r in runs] == ["spec", "nospec"]
    assert all(r["tokens"] == 2 * 8 and not r["errors"] for r in runs)
    assert runs[1]["draft_tokens"] == 0  # the server without speculation drafted nothing
