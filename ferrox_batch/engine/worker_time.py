"""`WorkerTime`: where the worker thread's wall time goes, for operators and the serving benchmark.

On a small CPU the worker shares its cores with the HTTP event loop, tokenization and detokenization.
Four totals, in seconds since start, say whether it is starved or crowded:

* `idle`: blocked on the channel with nothing to do (no request in flight);
* `scheduling`: its own Python between forwards (draining the channel, `schedule()`, `update()`, which
  streams text to every sink);
* `forward`: inside `Runner.execute` (the forward, the sampling, the host copies);
* `forward_off_cpu`: the part of `forward` the worker thread was not running (its wall time less its
  thread CPU time): descheduled for another thread, or asleep waiting for its OpenMP team. Torch's
  OpenMP threads spin while they wait, so on an uncontended machine this stays small; it grows when
  other threads take the worker's cores.

Written by the worker only; any thread may read a consistent snapshot, which counts an idle wait still
in progress up to the moment it is taken (so two snapshots bracket exactly the time between them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerTimes:
    """The four totals, in seconds (module docstring)."""

    idle_s: float = 0.0
    scheduling_s: float = 0.0
    forward_s: float = 0.0
    forward_off_cpu_s: float = 0.0


class WorkerTime:
    """The worker's running totals; `clock` is the one both the worker and readers measure with."""

    __slots__ = ("_idle", "_scheduling", "_forward", "_off_cpu", "_idle_since", "_clock", "_lock")

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._idle = self._scheduling = self._forward = self._off_cpu = 0.0
        self._idle_since: float | None = None
        self._clock = clock
        self._lock = threading.Lock()

    def begin_idle(self) -> None:
        """The worker is about to block with nothing to do."""
        with self._lock:
            self._idle_since = self._clock()

    def end_idle(self) -> None:
        """Work arrived: the wait since `begin_idle` counts as idle."""
        with self._lock:
            if self._idle_since is not None:
                self._idle += max(0.0, self._clock() - self._idle_since)
                self._idle_since = None

    def add_scheduling(self, seconds: float) -> None:
        with self._lock:
            self._scheduling += max(0.0, seconds)

    def add_forward(self, wall: float, cpu: float) -> None:
        """One `execute` call: its wall time and the worker thread's CPU time over it."""
        with self._lock:
            self._forward += max(0.0, wall)
            self._off_cpu += max(0.0, wall - cpu)

    def snapshot(self) -> WorkerTimes:
        with self._lock:
            idle = self._idle
            if self._idle_since is not None:
                idle += max(0.0, self._clock() - self._idle_since)
            return WorkerTimes(idle, self._scheduling, self._forward, self._off_cpu)
