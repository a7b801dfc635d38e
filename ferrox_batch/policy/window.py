"""`WindowPolicy`: the sliding-window arithmetic a paged row's hold is sized by.

A sliding-window model only attends to the last `sliding_window` positions, so
a paged row can give pages back while it decodes. The store does that in bursts
(every `eviction_interval` decode steps), so between two slides a row holds
more than the window. `slide_hold_bound` is the most positions a decoding row
can hold at once beyond its prompt; the admission ledger reserves by it
(`generate.paged_hold_positions`) instead of by `prompt + max_tokens`.

The anchor and decode-slide rules that decide *which* pages go (spec 3.5,
`policy/anchor`) are storage internals and live elsewhere when ported.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferrox_batch.checks import check_int

#: Decode steps between two window slides when the caller does not say.
DEFAULT_SWA_EVICTION_INTERVAL = 128

#: Positions kept past the window before anything is released (upstream's margin
#: so a tool-call anchor just outside the window is not dropped at once).
SWA_RETAIN_GAP = 16


@dataclass(frozen=True, slots=True)
class WindowPolicy:
    """One uniform sliding window over a paged store with `page_size` positions per page."""

    sliding_window: int
    page_size: int
    eviction_interval: int = DEFAULT_SWA_EVICTION_INTERVAL

    def __post_init__(self) -> None:
        check_int("sliding_window", self.sliding_window, minimum=1)
        check_int("page_size", self.page_size, minimum=1)
        check_int("eviction_interval", self.eviction_interval, minimum=1)

    @classmethod
    def new(cls, sliding_window: int, page_size: int) -> WindowPolicy:
        """Upstream's constructor: the default eviction interval (128)."""
        return cls(sliding_window, page_size, DEFAULT_SWA_EVICTION_INTERVAL)

    def with_eviction_interval(self, interval: int) -> WindowPolicy:
        """A copy sliding every `max(interval, 1)` decode steps (0 means every step, as upstream)."""
        if isinstance(interval, bool) or not isinstance(interval, int):
            raise TypeError(f"eviction_interval must be an integer, got {interval!r}")
        return WindowPolicy(self.sliding_window, self.page_size, max(interval, 1))


def slide_hold_bound(window: int, policy: WindowPolicy) -> int:
    """Most positions past the prompt a sliding row holds: `2*(window+16) + interval + 2*page`.

    `window` is passed separately from `policy` because upstream does so (a
    model may price a window other than the policy's); callers normally pass
    `policy.sliding_window`.
    """
    check_int("window", window, minimum=1)
    if not isinstance(policy, WindowPolicy):
        raise TypeError(f"policy must be a WindowPolicy, got {policy!r}")
    return 2 * (window + SWA_RETAIN_GAP) + policy.eviction_interval + 2 * policy.page_size
