"""`GbnfConverter`: llama.cpp GBNF grammars turned into Lark, in a process of their own, within a time limit.

Why a process: llguidance parses Lark natively (in Rust, within its limits) but converts GBNF with a Python
module (`llguidance.gbnf_to_lark`) whose cost grows with the square of some grammars' size (a chain of
rules: 77 KB took seconds). On a server thread that is GIL-holding work nobody can stop; in a child process
it is bounded: the child runs at the lowest CPU priority (the worker's forwards go first), is killed once it
has used `limit_s` of CPU, and is killed as soon as the request's `CancelToken` is cancelled (the client
left). The limit counts the child's CPU time, not the wall's: at the lowest priority on a busy machine a
cheap grammar's child may wait seconds for a core, which says nothing about the grammar, and a refusal
as too costly is remembered. A child that waits past `starved_s` on the wall (`STARVED_FACTOR` times the
limit, at least `STARVED_MIN_S`) is killed too, as busy (503, retry; nothing remembered).
At most `conversions` run at once; one more is refused as busy at once (a 503), so a flood of grammars
holds neither the server's prepare threads nor more than that many processes. Converted grammars are kept
by text (bounded), so a client that repeats its grammar converts it once; a grammar already in Lark is
never sent to a child. Which one a text is, `is_lark` tells in time linear in the text: llguidance's own
check (`gbnf_to_lark.is_lark_syntax`) is a regex whose time grows with the square of a run of newlines, on
this thread and holding the GIL (256 KiB of them would stop the worker for minutes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import OrderedDict

from llguidance import gbnf_to_lark

from ferrox_batch.cancel import CancelToken
from ferrox_batch.errors import DecodeError, GrammarConstraint

#: Conversions running at once: one core's worth at most, at the lowest priority.
CONVERSIONS = 1
#: Converted grammars kept (by their GBNF text), and the most bytes of text they may have together.
KEPT = 64
KEPT_BYTES = 4 * 1024 * 1024
#: How often a waiting conversion looks at its request's cancel token, in seconds.
POLL_S = 0.02
#: Wall time after which a child starved of CPU is given up as busy: this many times its CPU limit, and at
#: least `STARVED_MIN_S` (at the lowest priority, on a machine busy with other work, a child may get a
#: percent or two of a core).
STARVED_FACTOR = 20
STARVED_MIN_S = 30.0

# llguidance's `(?m)^\s*(%llguidance\b|start\s*:)` without its quadratic part: the line's leading `\s*` may
# cross newlines there, so every line start of a run of newlines scans the rest of the run; a match that
# crosses one is also a match from the line start after the last one it crosses, which is all this tries.
_LARK = re.compile(r"(?m)^[^\S\n]*(?:%llguidance\b|start\s*:)")

# The child: lowest priority, the converter module loaded by its path (not the llguidance package, whose
# native library it does not need), GBNF text on stdin, `{"lark": ...}` or `{"error": ...}` on stdout.
_CHILD = """
import importlib.util, json, os, sys
os.nice(19 - os.nice(0))
spec = importlib.util.spec_from_file_location("gbnf_to_lark", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
text = sys.stdin.read()
try:
    answer = {"lark": module.gbnf_to_lark(text)}
except Exception as bad:
    answer = {"error": f"{type(bad).__name__}: {bad}"}
sys.stdout.write(json.dumps(answer))
"""


class GbnfTimeout(Exception):
    """The conversion used more CPU than its limit (the caller turns it into its refusal, naming the field)."""


class GrammarCancelled(GrammarConstraint):
    """The request whose grammar was being converted was cancelled (its client left): its conversion stopped.
    Another request waiting on the same conversion converts it again with its own token."""

    _fields = ()

    def __init__(self) -> None:
        super().__init__("the grammar's conversion was cancelled: the request was cancelled")


class GbnfBusy(DecodeError):
    """Every conversion slot is taken, or the child got no CPU for too long: 503, retry shortly."""

    retry_after_secs = 1
    http_status = 503
    error_code = "server_busy"

    def __init__(self) -> None:
        super().__init__("server is at capacity: GBNF grammars are being converted; retry shortly")


class GbnfConverter:
    """Converts GBNF to Lark in child processes (module docstring); thread-safe."""

    def __init__(self, limit_s: float, conversions: int = CONVERSIONS, starved_s: float | None = None) -> None:
        self.limit_s = limit_s
        self.starved_s = max(limit_s * STARVED_FACTOR, STARVED_MIN_S) if starved_s is None else starved_s
        self._slots = threading.BoundedSemaphore(conversions)
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, str] = OrderedDict()
        self._kept_bytes = 0

    def to_lark(self, text: str, cancel: CancelToken | None = None) -> str:
        """`text` as Lark: as it is when it already is Lark, else converted in a child process.

        Raises `GrammarConstraint` for a grammar the converter refuses or a request cancelled meanwhile,
        `GbnfTimeout` past the CPU limit, `GbnfBusy` when every slot is taken or the child is starved of CPU."""
        if is_lark(text):
            return text
        with self._lock:
            known = self._kept.get(text)
            if known is not None:
                self._kept.move_to_end(text)
                return known
        if not self._slots.acquire(blocking=False):
            raise GbnfBusy()
        try:
            lark = self._convert(text, cancel)
        finally:
            self._slots.release()
        with self._lock:
            if text not in self._kept:
                self._kept[text] = lark
                self._kept_bytes += len(text) + len(lark)
            while self._kept and (len(self._kept) > KEPT or self._kept_bytes > KEPT_BYTES):
                old, converted = self._kept.popitem(last=False)
                self._kept_bytes -= len(old) + len(converted)
        return lark

    def _convert(self, text: str, cancel: CancelToken | None) -> str:
        # Started through `nice` where there is one, so even the interpreter's start-up yields to the worker.
        nice = shutil.which("nice")
        child = subprocess.Popen([*((nice, "-n", "19") if nice else ()), sys.executable, "-I", "-c", _CHILD,
                                  gbnf_to_lark.__file__],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        began = time.monotonic()
        payload: bytes | None = text.encode("utf-8", "surrogatepass")
        try:
            while True:
                try:
                    out, _ = child.communicate(payload, timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    payload = None  # sent with the first call
                if cancel is not None and cancel.is_cancelled():
                    raise GrammarCancelled()
                waited = time.monotonic() - began
                spent = _cpu_s(child.pid)
                if (waited if spent is None else spent) > self.limit_s:
                    raise GbnfTimeout()
                if waited > self.starved_s:
                    raise GbnfBusy()
        finally:
            if child.poll() is None:
                child.kill()
                child.communicate()
        try:
            answer = json.loads(out)
        except ValueError:
            raise GrammarConstraint("the grammar could not be converted from GBNF (its converter failed)") from None
        if "error" in answer:
            raise GrammarConstraint(f"the grammar cannot be converted from GBNF to Lark: {answer['error']}")
        return str(answer["lark"])


def is_lark(text: str) -> bool:
    """Whether `text` is a Lark grammar (else GBNF), as llguidance tells them apart, in time linear in `text`."""
    return _LARK.search(text) is not None


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user and system) process `pid` has used, from `/proc`; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # the fields after the command's name
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
