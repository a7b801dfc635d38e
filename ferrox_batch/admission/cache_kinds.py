"""Layer cache kinds: what one layer keeps per sequence, and what a lease of it costs in blocks.

A model's layers differ in what their KV cache must keep: a full-attention layer reads every position it
has seen, a sliding-window layer only its last `window` positions (so a lease may give the pages behind
them back, `admission.window`). Each kind is a small value behind the `CacheKind` protocol that prices its
own lease in the store's uniform blocks, says whether a lease sliding by a `WindowPolicy` slides it, and
names itself for logs and metrics. `admission.kv_groups` groups the layers by kind and sums these prices;
nothing there knows how many kinds exist, so a further kind (say a fixed-size recurrent state, a constant
number of state slots per sequence whatever its length) is one more class here, priced by the same ledger.

A layer described only as "local" (a bool, as the groups were first built) is `MODEL_WINDOW`: a sliding
window whose width is not written down, the model's one window, so it slides by whatever policy a lease
slides by. A kind built from a model config carries its width, and slides only by a policy of that width:
a layer that looked further back than the policy's window would read the pages it gives back.

Pure Python over ints (no torch): the handle prices with these on the caller's thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ferrox_batch.admission.block_budget import blocks_for
from ferrox_batch.admission.window import WindowPolicy
from ferrox_batch.checks import check_int

#: The labels of the two kinds today's models have (logs, metrics, `PagedKvStore.blocks_by_label`).
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"


@runtime_checkable
class CacheKind(Protocol):
    """What one layer's KV cache keeps per sequence. Implementations are immutable values (frozen
    dataclasses): equal kinds share groups, so a kind must hash and compare by value."""

    @property
    def label(self) -> str:
        """A short name for logs and metrics; kinds that differ only in a size share it."""
        ...

    @property
    def order(self) -> tuple[int, ...]:
        """Where this kind's groups come in a model's group order (ascending): full attention first.
        Two different kinds of one model must not share it, so the order never depends on layer order."""
        ...

    def slides_by(self, window: WindowPolicy | None) -> bool:
        """Whether a lease sliding by `window` slides this kind's groups (None: the lease does not slide)."""
        ...

    def blocks(self, positions: int, held: int, block_size: int) -> int:
        """Blocks one group of this kind leases for a row of `positions` positions (prompt + max_tokens),
        `held` of which its groups hold at once when it slides (`positions` when it does not)."""
        ...


@dataclass(frozen=True, slots=True)
class FullAttention:
    """A layer attending over every position: its lease keeps them all, `blocks_for(positions)`."""

    @property
    def label(self) -> str:
        return FULL_ATTENTION

    @property
    def order(self) -> tuple[int, ...]:
        return (0,)

    def slides_by(self, window: WindowPolicy | None) -> bool:
        return False

    def blocks(self, positions: int, held: int, block_size: int) -> int:
        return blocks_for(positions, block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """A layer attending over its last `window` positions (None: the model's one window, width unstated,
    `MODEL_WINDOW`). A lease that slides holds `held` positions (`window.paged_hold_positions`), one that
    does not holds every position; either way `blocks_for(held)`."""

    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None:
            check_int("window", self.window, minimum=1)

    @property
    def label(self) -> str:
        return SLIDING_WINDOW

    @property
    def order(self) -> tuple[int, ...]:
        return (1, self.window or 0)  # after full attention, narrower windows first

    def slides_by(self, window: WindowPolicy | None) -> bool:
        return window is not None and self.window in (None, window.sliding_window)

    def blocks(self, positions: int, held: int, block_size: int) -> int:
        return blocks_for(held, block_size)


#: A layer known only to be local: it attends over the model's one sliding window (module docstring).
MODEL_WINDOW = SlidingWindow()


def layer_kind(window: int | None) -> CacheKind:
    """The kind of a layer attending over its last `window` positions (a model config's
    `window(layer)`): `SlidingWindow(window)`, or `FullAttention()` for None (every position)."""
    return FullAttention() if window is None else SlidingWindow(window)


def as_kind(kind: CacheKind | bool) -> CacheKind:
    """`kind` itself, or the kind a layer's "is local" flag stands for: True `MODEL_WINDOW`, False
    `FullAttention()` (the form `KvGroups.of` first took)."""
    if isinstance(kind, CacheKind):
        return kind
    return MODEL_WINDOW if bool(kind) else FullAttention()


def lease_blocks(kind: CacheKind, window: WindowPolicy | None, positions: int, held: int, block_size: int) -> int:
    """Blocks one group of `kind` leases for a row of `positions` positions sliding by `window` (None: not
    sliding): `held` positions where `window` slides the kind, else every position. The one rule the
    pricing and the store share."""
    return kind.blocks(positions, held if kind.slides_by(window) else positions, block_size)
