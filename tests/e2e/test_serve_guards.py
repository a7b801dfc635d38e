"""`ferrox-batch serve`'s guard flags reach the server, and `serve` applies its defaults for them.

Pins: `--api-key` (repeated), `--shared-prefix-cache`, `--client-priorities`, `--drain-timeout` and
`--allowed-hosts` arrive at `server.run.serve` as its keywords (and, with `--replicas`, in every replica's
app settings), with the server's defaults when not given; `serve` bound to loopback checks `Host` against the loopback names, and one bound to all
interfaces checks nothing unless told; SIGTERM to the process drains a streaming request to its end and
exits 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest
from process_helpers import free_port, server_process, wait_healthy
from server_helpers import DEADLINE, poll

from ferrox_batch import cli
from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.cli import serve as serve_cli
from ferrox_batch.server.http.listener import DEFAULT_DRAIN_TIMEOUT_SECS
from ferrox_batch.server.run import serve


def parse(*flags: str):
    return cli.build_parser().parse_args(["serve", "--kv-blocks", "64", *flags])


@pytest.fixture
def captured(monkeypatch, tiny_batch_model) -> dict:
    got: dict = {}
    monkeypatch.setattr(serve_cli, "_signals_unwind", lambda: None)
    monkeypatch.setattr(serve_cli, "_setup_logging", lambda level: None)
    monkeypatch.setattr(serve_cli, "load", lambda args, env: tiny_batch_model)
    monkeypatch.setattr("ferrox_batch.server.run.serve", lambda *args, **kwargs: got.update(kwargs))
    return got


def test_the_flags_reach_serve(captured):
    args = parse("--api-key", "sk-a", "--api-key", "sk-b", "--shared-prefix-cache", "--client-priorities", "0:3",
                 "--drain-timeout", "12.5", "--allowed-hosts", "api.example.com", "--escape-control-tokens")
    assert serve_cli.cmd_serve(args, {}) == 0
    assert captured["escape_control_tokens"] is True
    assert captured["api_key"] == ("sk-a", "sk-b") and captured["shared_prefix_cache"] is True
    assert captured["client_priorities"] == (0, 3) and captured["drain_timeout"] == 12.5
    assert captured["allowed_hosts"] == ("api.example.com",)


def test_the_defaults_reach_serve(captured):
    assert serve_cli.cmd_serve(parse(), {}) == 0
    assert captured["api_key"] == () and captured["shared_prefix_cache"] is False
    assert captured["client_priorities"] == (0, 0) and captured["allowed_hosts"] is None
    assert captured["drain_timeout"] == DEFAULT_DRAIN_TIMEOUT_SECS
    assert captured["escape_control_tokens"] is False


def test_the_drain_default_repeated_for_the_cli_matches_the_servers():
    from ferrox_batch.cli.common import DEFAULT_DRAIN_TIMEOUT_SECS as cli_default

    assert cli_default == DEFAULT_DRAIN_TIMEOUT_SECS
    assert parse("--drain-timeout", "0").drain_timeout == 0.0
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(SystemExit):
            parse("--drain-timeout", bad)


def test_the_replicas_get_the_same_app_settings(monkeypatch):
    pytest.importorskip("ray", reason="needs the test extra (ray[serve])")
    from ferrox_batch.cli.replicas import replica_app_settings
    from ferrox_batch.deploy.ray_serve import ReplicaSpec

    args = parse("--replicas", "2", "--api-key", "sk-a", "--client-priorities", "1:2", "--allowed-hosts", "h.example",
                 "--shared-prefix-cache", "--escape-control-tokens")
    settings = replica_app_settings(args, ("sk-a",))
    assert settings["escape_control_tokens"] is True
    assert settings["api_key"] == ("sk-a",) and settings["client_priorities"] == (1, 2)
    assert settings["allowed_hosts"] == ("h.example",) and settings["shared_prefix_cache"] is True
    ReplicaSpec("/m", app=settings)  # every setting is one the replicas' app takes
    loopback = replica_app_settings(parse("--replicas", "2"), ())
    assert loopback["allowed_hosts"] == ("localhost", "127.0.0.1", "[::1]")  # bound to 127.0.0.1 by default


@contextlib.contextmanager
def serving(model, host: str, **options) -> Iterator[str]:
    port = free_port()
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(model, BatcherConfig(kv_block_size=16, kv_blocks=64), host, port),
                              kwargs={"stop": stop, "log_level": "warning", **options}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(url + "/health", timeout=1).status_code == 200
        return False

    try:
        poll(up, "serve to answer", timeout=60)
        yield url
    finally:
        stop.set()
        thread.join(DEADLINE)
        assert not thread.is_alive()


def test_serve_on_loopback_checks_the_host_and_on_all_interfaces_does_not(tiny_batch_model):
    with serving(tiny_batch_model, "127.0.0.1") as url:
        assert httpx.get(url + "/v1/models", timeout=DEADLINE).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"Host": "localhost:1"}, timeout=DEADLINE).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"Host": "rebound.example"}, timeout=DEADLINE).status_code == 400
    with serving(tiny_batch_model, "0.0.0.0") as url:
        assert httpx.get(url + "/v1/models", headers={"Host": "rebound.example"}, timeout=DEADLINE).status_code == 200
    with serving(tiny_batch_model, "0.0.0.0", allowed_hosts=("api.example.com",)) as url:
        assert httpx.get(url + "/v1/models", headers={"Host": "rebound.example"}, timeout=DEADLINE).status_code == 400
        assert httpx.get(url + "/v1/models", headers={"Host": "api.example.com"}, timeout=DEADLINE).status_code == 200


@pytest.mark.slow  # a real process (~15 s); tests/server/test_drain.py pins the same in process
def test_sigterm_drains_a_request_in_flight_to_its_end_and_exits_0(tiny_batch_dir):
    # 400 tokens take the tiny model far longer than the signal takes to arrive (hundreds of decode steps
    # against one syscall), so the request is in flight when it does. Not with drafts: where the tiny model's
    # greedy output falls into a loop, prompt lookup drafts it whole and the 400 tokens take a few steps.
    port = free_port()
    argv = [sys.executable, "-m", "ferrox_batch.cli", "serve", "--model", str(tiny_batch_dir), "--port", str(port),
            "--kv-memory", "1MiB", "--kv-block-size", "16", "--dtype", "float32", "--device", "cpu",
            "--model-name", "tiny", "--drain-timeout", "60", "--no-speculative"]
    with server_process(argv) as server:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, server, timeout=60)
        body = {"prompt": "Hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # generating
            os.kill(server.proc.pid, signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the stream ran to its end after the signal
        assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        server.proc.wait(60)
        assert server.proc.returncode == 0
        with pytest.raises(httpx.TransportError):  # nothing listens any more
            httpx.get(f"{base_url}/health", timeout=5)
    output = server.output()
    assert "Traceback" not in output, output
    assert "Waiting for connections to close" in output, output  # the stream was open when the signal came
