"""Which waiting job to admit next: bounded, cache-aware, and starvation-free.

Strict FIFO cannot starve, which is why the upstream kept it. This pick
reorders by how much of a prompt is already in the prefix cache -- a
property of the *server's* state, not of the request, and one that removes
work instead of just moving it (cached pages are attended, not recomputed;
under page pressure a cached job that waits can lose its hit). Two hard
bounds keep it from starving anybody:

* only the first `WINDOW` waiting jobs are considered, so a long queue is
  never re-sorted end to end;
* a job passed over `MAX_SKIPS` times can no longer be overtaken, and
  neither can anything behind it.

Ties keep arrival order, so a cold server (every depth 0) is exactly FIFO.
The caller owns the skip counters (they ride on the job) and increments the
counter of every job the pick jumped over.
"""

from __future__ import annotations

from collections.abc import Sequence

from ferrox_batch.checks import check_int

__all__ = ["MAX_SKIPS", "WINDOW", "choose"]

WINDOW = 8
"""How many waiting jobs are looked at."""

MAX_SKIPS = 4
"""How many times a job may be passed over before nothing may overtake it."""


def _counts(values: object, name: str) -> list[int]:
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of non-negative ints, got {type(values).__name__}")
    return [check_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


def choose(depths: Sequence[int], skips: Sequence[int]) -> int:
    """Index of the job to admit: `depths[i]` is job i's cached-prefix length
    and `skips[i]` how often it has been passed over, in queue order. Both
    must have the same length (the caller builds them from one queue);
    entries past `WINDOW` are ignored."""
    depths = _counts(depths, "depths")
    skips = _counts(skips, "skips")
    if len(depths) != len(skips):
        raise ValueError(
            f"depths and skips must describe the same jobs, got {len(depths)} depths and {len(skips)} skips"
        )
    if len(depths) < 2:
        return 0
    # The head's bound is checked before the scan, not folded into the
    # ranking: a bound that is one term of a score is one a large enough
    # other term defeats.
    if skips[0] >= MAX_SKIPS:
        return 0
    best = 0
    for i in range(1, min(len(depths), WINDOW)):
        # A job at the bound cannot be overtaken, so the scan stops at it;
        # stepping past would protect it by starving the job behind it.
        if skips[i] >= MAX_SKIPS:
            break
        if depths[i] > depths[best]:  # strictly: ties keep arrival order
            best = i
    return best
