"""`ferrox-batch serve --replicas 2`, as a process: it starts Ray with every port on loopback (its `--host`),
answers, and stops cleanly on SIGTERM (what Kubernetes and systemd send; Ray installs its own handler, which
`serve` replaces)."""

from __future__ import annotations

import ipaddress
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from process_helpers import free_port, server_process, wait_healthy, wait_port_free

from ferrox_batch.deploy.relay import REPLICA_HEADER

pytest.importorskip("ray", reason="needs the test extra (ray[serve])")
pytestmark = pytest.mark.slow


def listening_addresses(pid: int) -> dict[tuple[str, int], str]:
    """(process name, port) -> address of every socket listening in process `pid` and its descendants."""
    import psutil

    root = psutil.Process(pid)
    names: dict[int, str] = {}
    # Ray starts and ends short-lived helpers at any time: one gone between the listing and the read is skipped.
    for process in (root, *root.children(recursive=True)):
        try:
            names[process.pid] = process.name()
        except psutil.NoSuchProcess:
            continue
    return {(names[c.pid], c.laddr.port): c.laddr.ip for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in names}


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def test_serve_with_replicas_answers_and_stops_cleanly_on_sigterm(tiny_batch_dir: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "ferrox_batch.cli", "serve", "--model", str(tiny_batch_dir), "--port", str(port),
            "--kv-memory", "1MiB", "--dtype", "float32", "--device", "cpu", "--model-name", "tiny-cli",
            "--replicas", "2", "--max-seqs", "8"]
    with server_process(argv) as server:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, server, timeout=180)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["tiny-cli"]
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-cli", max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Hi"}],
            extra_body={"ignore_eos": True})
        assert raw.parse().usage.completion_tokens == 8 and raw.headers[REPLICA_HEADER]
        stats = httpx.get(f"{base_url}/stats", timeout=30).json()
        assert stats["max_seqs"] == 8 and stats["worker_alive"]
        # The GCS, the raylet, Ray's agents, every replica's worker and Serve's proxy: none beyond loopback.
        listening = listening_addresses(server.proc.pid)
        assert port in {p for _, p in listening} and len(listening) > 5, listening
        assert not {k: v for k, v in listening.items() if not is_loopback(v)}
        # To the serve process alone, as Kubernetes signals a container's first process: it drains the
        # replicas through Ray. (A whole-group signal kills Ray's own processes under it first.)
        os.kill(server.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while server.proc.poll() is None:
            assert time.monotonic() < deadline, "serve --replicas did not stop on SIGTERM"
            time.sleep(0.1)
    assert server.stopped_by == "already", server.output()[-3000:]
    assert server.proc.returncode == 0
    assert "Traceback" not in server.output()
    assert wait_port_free(port)


def test_replica_flags_need_replicas() -> None:
    from ferrox_batch.cli import main

    assert main(["serve", "--max-replicas", "3"], {}) == 2
    assert main(["serve", "--replicas", "3", "--max-replicas", "2"], {}) == 2
    assert main(["serve", "--router", "default"], {}) == 2
