"""Paged KV configuration and the hold arithmetic admission reserves by (spec 3.5).

Upstream keeps these in its `generate` module; they live here so that module
stays one concept a file, and `ferrox_batch.generate` re-exports them where a
reader of the spec looks. Pure arithmetic over ints: the store itself is typed
loosely because it lives in the model layer, which this module must not import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferrox_batch.checks import check_int, check_seconds
from ferrox_batch.policy.window import WindowPolicy, slide_hold_bound

__all__ = ["PagedKvConfig", "paged_hold_positions", "paged_window_policy"]


@dataclass(frozen=True, slots=True)
class PagedKvConfig:
    """How the batcher reaches the paged KV store.

    `store` is the runtime's paged store (typed loosely: it lives in the model
    layer, which this module must not import). `queue_wait` is seconds to wait
    for pages at admission (0.0 = try once). `radix` is the optional shared
    prefix tree; `anchor_token` the single token id that opens a tool call;
    `slide_interval` the decode steps between two window slides. They mirror
    the upstream type; `ContinuousBatcher` refuses all but `store` at other
    than their defaults, since it has none of those features.
    """

    store: Any
    queue_wait: float = 0.0
    radix: Any = None
    anchor_token: int | None = None
    slide_interval: int = 128

    def __post_init__(self) -> None:
        object.__setattr__(self, "queue_wait", check_seconds("queue_wait", self.queue_wait))
        if self.anchor_token is not None:
            check_int("anchor_token", self.anchor_token)
        check_int("slide_interval", self.slide_interval)


def paged_hold_positions(max_seq_len: int, prompt_len: int, block_size: int, window: WindowPolicy | None) -> int:
    """Positions a paged row can hold at once: what admission reserves blocks for.

    Without a window that is `max_seq_len` (prompt + max_tokens). With one, a
    row gives pages back as it slides, so it never holds more than its prompt,
    the slide bound and one block of slack, and never more than `max_seq_len`.
    """
    check_int("max_seq_len", max_seq_len)
    check_int("prompt_len", prompt_len)
    check_int("block_size", block_size, minimum=1)
    if window is None:
        return max_seq_len
    if not isinstance(window, WindowPolicy):
        raise TypeError(f"window must be a WindowPolicy or None, got {window!r}")
    return min(prompt_len + slide_hold_bound(window.sliding_window, window) + block_size, max_seq_len)


def paged_window_policy(sliding_window: int | None, paged: PagedKvConfig | None, block_size: int) -> WindowPolicy | None:
    """The window policy a paged row slides by, or None.

    Upstream reads the decoder's per-layer windows and answers only when every
    layer slides by the same one. This runtime's models have one uniform window
    or none (`ModelConfig.sliding_window`), so the caller passes that window,
    the paged configuration (None = contiguous rows, which never slide) and the
    store's block (page) size.
    """
    check_int("block_size", block_size, minimum=1)
    if sliding_window is None or paged is None:
        return None
    check_int("sliding_window", sliding_window, minimum=1)
    if not isinstance(paged, PagedKvConfig):
        raise TypeError(f"paged must be a PagedKvConfig or None, got {paged!r}")
    return WindowPolicy.new(sliding_window, block_size).with_eviction_interval(paged.slide_interval)
