"""Helpers for the tests that run the server as a separate process (`ferrox-batch serve`, `make serve`).

* `free_port()`: a port nothing listens on now (bound to port 0 and released);
* `server_process(argv, ...)`: start the command in its own process group
  (a new session), with its output in a file (a pipe nobody reads could fill
  and stall it), and stop the whole group on the way out however the test
  ends: SIGINT, then SIGTERM, then SIGKILL, each after a wait. Nothing it
  started can outlive the test;
* `wait_healthy(...)`: poll `/health` until 200, failing early (with the
  process's output) if the process exits;
* `port_is_free(port)`: nothing listens on it any more.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    """True when a new socket can bind `127.0.0.1:port` (SO_REUSEADDR, as servers do: TIME_WAIT is fine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    log_path: Path
    #: The signal that ended the group ("already" when none was needed); set on exit.
    stopped_by: str | None = None
    #: Everything the process wrote, kept once its temporary log file is gone.
    final_output: str | None = None

    def output(self) -> str:
        if self.final_output is not None:
            return self.final_output
        return self.log_path.read_text(encoding="utf-8", errors="replace")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a zombie or a process we cannot signal still counts as there
        return True
    return True


def _wait_group(proc: subprocess.Popen, pgid: int, timeout: float) -> bool:
    """Wait until the leader is reaped and no process of the group is left; True when that happened."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.1)
        if proc.returncode is not None and not _group_alive(pgid):
            return True
        time.sleep(0.05)
    return False


def stop_group(proc: subprocess.Popen, *, sigint_wait: float = 30.0, sigterm_wait: float = 10.0) -> str:
    """SIGINT the group, then SIGTERM, then SIGKILL; return which one ended it ("already" if none was needed)."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    if proc.poll() is not None and not _group_alive(pgid):
        return "already"
    for signum, wait in ((signal.SIGINT, sigint_wait), (signal.SIGTERM, sigterm_wait), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signum)
        if _wait_group(proc, pgid, wait):
            return signum.name
    raise AssertionError(f"process group {pgid} survived SIGKILL")


@contextlib.contextmanager
def server_process(argv: Sequence[str], *, cwd: str | Path | None = None,
                   env: Mapping[str, str] | None = None) -> Iterator[ServerProcess]:
    with tempfile.TemporaryDirectory(prefix="ferrox-server-") as tmp:
        log_path = Path(tmp) / "output.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(list(argv), cwd=cwd, env=dict(env) if env is not None else None,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        server = ServerProcess(proc, log_path)
        try:
            yield server
        finally:
            server.stopped_by = stop_group(proc)
            server.final_output = server.output()


def wait_healthy(base_url: str, server: ServerProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise AssertionError(f"the server exited with status {server.proc.returncode} before it was "
                                 f"healthy; its output:\n{server.output()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"no healthy server at {base_url} after {timeout:.0f} s; its output:\n"
                                 f"{server.output()[-4000:]}")
        time.sleep(0.2)


def wait_port_free(port: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not port_is_free(port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
