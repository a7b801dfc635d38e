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

Written by the worker only; any thread may read a consistent snapshot.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerTimes:
    idle_s: float = 0.0
    scheduling_s: float = 0.0
    forward_s: float = 0.0
    forward_off_cpu_s: float = 0.0


class WorkerTime:
    __slots__ = ("_idle", "_scheduling", "_forward", "_off_cpu", "_lock")

    def __init__(self) -> None:
        self._idle = self._scheduling = self._forward = self._off_cpu = 0.0
        self._lock = threading.Lock()

    def add_idle(self, seconds: float) -> None:
        with self._lock:
            self._idle += max(0.0, seconds)

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
            return WorkerTimes(self._idle, self._scheduling, self._forward, self._off_cpu)
