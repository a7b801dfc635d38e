"""The sliding-window hold arithmetic: what a row of a sliding-window model holds, and when it slides.

A model whose every layer attends only to its last `window` positions never reads a key behind the window
again, so a paged lease can give those pages back while the row runs and reuse them for new positions.
Sliding after every token would cost a block-table update per token, so a decoding row slides every
`eviction_interval` steps (a prompt's chunks slide before each chunk), and between two slides its pages
reach at most that far past the window. The ledger must price such a row by the most it can ever hold at
once, not by `prompt + max_tokens`: `paged_hold_positions`. This module is that arithmetic, pure Python
over ints (docs/upstream.md, Paged KV and held positions; D8):

* `WindowPolicy`: the window, the page (the store's block) and the slide interval;
* `slide_hold_bound` and `paged_hold_positions`: the positions a sliding row is priced at;
* `decode_slide` and `prefill_slide`: which positions a slide gives back, whole pages below a threshold
  that keeps every key a query inside the window still reads;
* `row_hold`: what one request is priced at and whether its lease slides at all.

The upstream's slide rules also keep a tool-call anchor alive behind the window (the position of the
first tool-call opener of a turn); this engine has no anchor, so the rules here are the upstream's without
it (D8).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ferrox_batch.admission.block_budget import blocks_for
from ferrox_batch.checks import check_int

#: Decode steps between two slides of a row when nothing else is configured (the upstream's).
DEFAULT_SWA_EVICTION_INTERVAL = 128
#: Positions the hold bound keeps past the window on each side of a slide (the upstream's margin).
SWA_RETAIN_GAP = 16


@dataclass(frozen=True, slots=True)
class WindowPolicy:
    """How a sliding lease slides: its window, its page (the store's block size) and the decode steps
    between two slides."""

    sliding_window: int
    page_size: int
    eviction_interval: int = DEFAULT_SWA_EVICTION_INTERVAL

    def __post_init__(self) -> None:
        check_int("sliding_window", self.sliding_window, minimum=1)
        check_int("page_size", self.page_size, minimum=1)
        check_int("eviction_interval", self.eviction_interval, minimum=1)

    @classmethod
    def new(cls, window: int, page: int) -> WindowPolicy:
        return cls(window, page, DEFAULT_SWA_EVICTION_INTERVAL)

    def with_eviction_interval(self, interval: int) -> WindowPolicy:
        """The same policy sliding every `interval` decode steps (at least every step)."""
        return dataclasses.replace(self, eviction_interval=max(interval, 1))


def window_policy(uniform_window: int | None, page_size: int, interval: int) -> WindowPolicy | None:
    """The policy of a store of `page_size`-position blocks for a model whose layers all slide by
    `uniform_window` (None: some layer attends globally, or none slides, so no page is ever behind every
    layer's window and nothing slides)."""
    if uniform_window is None:
        return None
    return WindowPolicy.new(uniform_window, page_size).with_eviction_interval(interval)


def slide_hold_bound(window: int, policy: WindowPolicy) -> int:
    """Positions past its prompt a sliding row holds at most: the window and the margin on both sides of a
    slide, a slide interval of new positions, and two pages of alignment."""
    return 2 * (window + SWA_RETAIN_GAP) + policy.eviction_interval + 2 * policy.page_size


def paged_hold_positions(max_seq_len: int, prompt_len: int, block_size: int, window: WindowPolicy | None) -> int:
    """The positions a row of `max_seq_len` (prompt + max_tokens) holds at once: all of them without a
    window; with one, its prompt (a prompt is priced whole: it may run in one chunk) plus the hold bound
    and a block, never more than `max_seq_len`."""
    check_int("max_seq_len", max_seq_len)
    check_int("prompt_len", prompt_len)
    check_int("block_size", block_size, minimum=1)
    if window is None:
        return max_seq_len
    return min(prompt_len + slide_hold_bound(window.sliding_window, window) + block_size, max_seq_len)


@dataclass(frozen=True, slots=True)
class RowHold:
    """What admission prices a row at: the positions its lease holds, and the policy it slides by (None:
    it keeps every position, as a row of a model without a uniform window does)."""

    positions: int
    window: WindowPolicy | None


def row_hold(prompt_len: int, max_seq_len: int, block_size: int, window: WindowPolicy | None) -> RowHold:
    """A row slides only when that saves blocks: a row whose hold bound is no smaller in blocks than its
    whole length keeps every page (and with them the prefix cache, which a sliding row cannot use)."""
    held = paged_hold_positions(max_seq_len, prompt_len, block_size, window)
    if window is None or blocks_for(held, block_size) >= blocks_for(max_seq_len, block_size):
        return RowHold(max_seq_len, None)
    return RowHold(held, window)


@dataclass(frozen=True, slots=True)
class SlideRequest:
    """Where a sliding row stands when it may slide: `position` is the next position it writes (its KV
    length), `already_released` the positions below which it gave every page back, `locked_prefix` the
    positions it must keep whatever the window (pages shared with others), `decode_step` its decode steps
    so far, this one included."""

    position: int
    already_released: int = 0
    locked_prefix: int = 0
    decode_step: int = 0


@dataclass(frozen=True, slots=True)
class Release:
    """Positions `[start, end)` to give back: whole pages."""

    start: int
    end: int


def decode_slide(request: SlideRequest, policy: WindowPolicy, forward_iter: int) -> Release | None:
    """The slide before a decode step: only every `eviction_interval`-th forward, and only once the row
    decodes. The token written at `position` attends to positions above `position - window`; the threshold
    stays a further page below that."""
    if forward_iter % policy.eviction_interval != 0 or request.decode_step < 1:
        return None
    return _release((request.position - 1) - policy.sliding_window - policy.page_size, request, policy)


def prefill_slide(request: SlideRequest, policy: WindowPolicy) -> Release | None:
    """The slide before each prompt chunk: the chunk's first query (at `position`) reads positions above
    `position - window`; the threshold stays a page below that."""
    return _release(request.position - policy.sliding_window - policy.page_size, request, policy)


def _release(threshold: int, request: SlideRequest, policy: WindowPolicy) -> Release | None:
    start = max(request.already_released, request.locked_prefix)
    aligned = threshold // policy.page_size * policy.page_size  # floor division: down, also when negative
    return Release(start, aligned) if aligned > start else None
