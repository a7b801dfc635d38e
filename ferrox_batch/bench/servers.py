"""The servers a serving benchmark starts: ours with a set of flags, or a peer from its own command line.

Each is a child process on a free loopback port, ready once `GET /health` answers 200 (llama.cpp's
`llama-server` answers 503 while it loads), stopped with SIGINT (killed if it has not exited within a
minute). A peer's command is a template whose `{port}` is filled in, so any OpenAI-compatible server
that takes its port on the command line can be measured beside ours.
"""

from __future__ import annotations

import http.client
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass


def free_port() -> int:
    """A loopback port nothing listens on now (bound to port 0, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """A named configuration: our server's flags, or (peer) a command template with `{port}`."""

    name: str
    flags: tuple[str, ...] = ()
    peer_command: str | None = None

    @property
    def is_peer(self) -> bool:
        return self.peer_command is not None

    def describe(self) -> str:
        if self.peer_command is not None:
            return self.peer_command
        return f"ferrox-batch serve {' '.join(self.flags) or '(defaults)'}"


def parse_spec(spec: str, *, peer: bool = False) -> ServerSpec:
    """`NAME=FLAGS` (ours) or, with `peer`, `NAME=COMMAND` where COMMAND holds `{port}`."""
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise SystemExit(f"{'--peer' if peer else '--config'} takes NAME={'COMMAND' if peer else 'FLAGS'}, got {spec!r}")
    if not peer:
        return ServerSpec(name, tuple(shlex.split(rest)))
    if "{port}" not in rest:
        raise SystemExit(f"--peer {name}: the command must say where the port goes with {{port}}, got {rest!r}")
    return ServerSpec(name, peer_command=rest)


class Server:
    """One configuration's server in a child process, on a free loopback port."""

    def __init__(self, spec: ServerSpec, model: str, device: str, dtype: str, env: Mapping[str, str]) -> None:
        self.port = free_port()
        # Ours is only what its flags say: no FERROX_CB_* of the caller's leaks in.
        child_env = {k: v for k, v in env.items() if not k.startswith("FERROX_CB_")}
        if spec.peer_command is not None:
            argv = shlex.split(spec.peer_command.replace("{port}", str(self.port)))
        else:
            argv = [sys.executable, "-m", "ferrox_batch.cli", "serve", "--model", model, "--device", device,
                    "--dtype", dtype, "--port", str(self.port), "--log-level", "warning", *spec.flags]
        self.proc = subprocess.Popen(argv, env=child_env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL if spec.is_peer else None,
                                     stderr=subprocess.DEVNULL if spec.is_peer else None)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before it was ready")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not ready within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
