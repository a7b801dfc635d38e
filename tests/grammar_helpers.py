"""Helpers for the grammar-compile tests: a recorder of llguidance's compile work, and the schemas.

`BuildRecorder` stands in for `llguidance.LLMatcher` (monkeypatched onto the module, which is how
`runtime.sampling.grammar` reaches it): every matcher built and every grammar validated is recorded with the thread
that did it, then handed to the real class. Other static methods pass through unrecorded, and a row's copy
(`deep_copy` on an instance) is not a build, so it is not recorded. `gate`: when set, the first recorded
call waits on it (to hold a compile in flight).

The schemas (`tool_schemas`, `optional_properties`) are the benchmarks' own (`ferrox_batch.bench.schemas`).
"""

from __future__ import annotations

import threading
from typing import Any

from ferrox_batch.bench.schemas import optional_properties, tool_schemas

__all__ = ["BuildRecorder", "optional_properties", "tool_schemas"]


class BuildRecorder:
    def __init__(self, real: Any, gate: threading.Event | None = None) -> None:
        self._real = real
        self._gate = gate
        self._lock = threading.Lock()
        self.threads: list[str] = []  # one entry per build or validation, the thread's name

    def _record(self) -> None:
        with self._lock:
            self.threads.append(threading.current_thread().name)
            first = len(self.threads) == 1
        if first and self._gate is not None:
            assert self._gate.wait(30), "the test never released the gate"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._record()
        return self._real(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._real, name)
        if not name.startswith("validate_grammar"):
            return attribute

        def validating(*args: Any, **kwargs: Any) -> Any:
            self._record()
            return attribute(*args, **kwargs)

        return validating
