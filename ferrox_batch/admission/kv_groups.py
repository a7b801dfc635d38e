"""KV groups: a model's layers split into groups of one cache kind each, and what a row costs over them.

A model whose layers differ in what their cache keeps (Gemma 3: five sliding-window layers, over the last
`window` positions, to one full-attention layer) keeps every position only in its full-attention layers;
its sliding layers read their window alone, so a lease may slide their pages (`admission.window`) while
the others keep every position. Each layer has a kind (`admission.cache_kinds`). One pool of uniform
blocks serves every kind: the layers are split into groups of `size` layers of one kind, and one block
holds `size` layers' K/V for `block_size` positions. Each sequence holds one block table per group,
ordinary in a full-attention group, sliding in a sliding one.

The grouping rule: `size` is the smallest layer count of any kind the model has (a model of one kind is
one group of all its layers, exactly the layout of a store without groups), and a kind whose count it
does not divide pads its last group. The kinds come in their own `order` (full attention first), each
kind's layers in layer order. That keeps the number of groups, and with it the per-forward work and the
tables each sequence keeps, near `layers / size`, at the cost of at most `size - 1` unused layer slots
per kind; for the Gemma 3 checkpoints whose full-attention count divides the sliding one (270M: 15 and
3, 12B: 40 and 8) nothing is padded.

The pricing, `GroupPricing`, is the one place the ledger and the store agree on: a row costs the sum over
its groups of each group's kind's lease (`cache_kinds.lease_blocks`): `blocks_for(prompt + max_tokens)`
for full attention, `blocks_for(hold)` for a sliding window, the hold from `window.row_hold`. Pure
Python over ints (no torch): the handle prices with it on the caller's thread, and the store leases
exactly what it prices.

The first form of these groups knew one distinction, a layer's "is local" flag; it still works
everywhere (`KvGroups.of` takes flags, `local`, `global_groups` and `local_groups` are read off the
kinds, `GroupPricing(global_groups, local_groups, window)` builds from counts): a flag set is
`cache_kinds.MODEL_WINDOW`, the model's one window, which slides by whatever policy a lease slides by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ferrox_batch.admission.cache_kinds import (
    MODEL_WINDOW,
    CacheKind,
    FullAttention,
    SlidingWindow,
    as_kind,
    lease_blocks,
)
from ferrox_batch.admission.window import WindowPolicy, row_hold
from ferrox_batch.checks import check_int


@dataclass(frozen=True, slots=True)
class KvGroups:
    """Which layers each group holds (`layers[k]`, at most `size` of them, in slot order), its cache kind
    (`kinds[k]`; "is local" flags are taken too, `cache_kinds.as_kind`), and, derived from `layers`,
    where each layer lives (`slots[i]`: `(group, index within it)`, read once per layer of every forward)."""

    size: int
    layers: tuple[tuple[int, ...], ...]
    kinds: tuple[CacheKind, ...]
    slots: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kinds", tuple(as_kind(kind) for kind in self.kinds))
        if len(self.kinds) != len(self.layers):
            raise ValueError(f"{len(self.layers)} groups need one kind each, got {len(self.kinds)}")
        where = {layer: (group, index) for group, members in enumerate(self.layers)
                 for index, layer in enumerate(members)}
        object.__setattr__(self, "slots", tuple(where[layer] for layer in range(len(where))))

    @classmethod
    def of(cls, layer_kinds: Sequence[CacheKind | bool]) -> KvGroups:
        """The groups of a model whose layer `i` is of kind `layer_kinds[i]` (or local when that is a true
        flag, global when a false one) (module docstring)."""
        if not layer_kinds:
            raise ValueError("a model has at least one layer")
        members: dict[CacheKind, list[int]] = {}
        for layer, kind in enumerate(layer_kinds):
            members.setdefault(as_kind(kind), []).append(layer)
        present = sorted(members, key=lambda kind: kind.order)
        for first, second in zip(present, present[1:]):
            if first.order == second.order:
                raise ValueError(f"the kinds {first!r} and {second!r} share the order {first.order}")
        size = min(len(layers) for layers in members.values())
        layers: list[tuple[int, ...]] = []
        kinds: list[CacheKind] = []
        for kind in present:
            of_kind = members[kind]
            for start in range(0, len(of_kind), size):
                layers.append(tuple(of_kind[start:start + size]))
                kinds.append(kind)
        return cls(size, tuple(layers), tuple(kinds))

    @property
    def local(self) -> tuple[bool, ...]:
        """Per group, whether its layers attend over a sliding window."""
        return tuple(isinstance(kind, SlidingWindow) for kind in self.kinds)

    @property
    def global_groups(self) -> int:
        """Groups of full-attention layers."""
        return sum(1 for kind in self.kinds if isinstance(kind, FullAttention))

    @property
    def local_groups(self) -> int:
        """Groups of sliding-window layers."""
        return sum(self.local)

    def slot(self, layer: int) -> tuple[int, int]:
        """`(group, index within its group)` of `layer`: it reads and writes `pool[index]` through that
        group's tables."""
        if not 0 <= layer < len(self.slots):
            raise ValueError(f"layer {layer} is in no KV group")
        return self.slots[layer]

    def pricing(self, window: WindowPolicy | None) -> GroupPricing:
        """What a row costs over these groups when a lease slides by `window` (None: nothing slides, nor
        does anything when no group's kind slides by it: a model without sliding layers never does)."""
        slides = any(kind.slides_by(window) for kind in self.kinds)
        return GroupPricing(kinds=self.kinds, window=window if slides else None)


@dataclass(frozen=True, slots=True)
class GroupHold:
    """What admission prices a row at: `positions` held at once by each group that keeps every position
    (prompt + max_tokens), `held` by each sliding group (its hold bound when it slides, else `positions`),
    `window` the policy its sliding groups slide by (None: none slides), and the blocks all that takes."""

    positions: int
    held: int
    window: WindowPolicy | None
    blocks: int


@dataclass(frozen=True, slots=True, init=False)
class GroupPricing:
    """Each group's cache kind, in group order, and the policy a lease slides by (None: none slides): the
    row arithmetic of the ledger and the store (module docstring).

    Built from kinds, `GroupPricing(kinds=..., window=...)`, or from counts as first written,
    `GroupPricing(global_groups, local_groups, window)`: that many full-attention groups and then that
    many over the model's window (`MODEL_WINDOW`). `GroupPricing(1, 0, None)` is a store without windows.
    """

    kinds: tuple[CacheKind, ...]
    window: WindowPolicy | None

    def __init__(self, global_groups: int = 0, local_groups: int = 0, window: WindowPolicy | None = None, *,
                 kinds: Sequence[CacheKind] | None = None) -> None:
        check_int("global_groups", global_groups)
        check_int("local_groups", local_groups)
        if kinds is None:
            kinds = (FullAttention(),) * global_groups + (MODEL_WINDOW,) * local_groups
        elif global_groups or local_groups:
            raise ValueError("a pricing is built from group counts or from kinds, not both")
        kinds = tuple(as_kind(kind) for kind in kinds)
        if not kinds:
            raise ValueError("a store has at least one KV group")
        if window is not None and not any(kind.slides_by(window) for kind in kinds):
            raise ValueError(f"only local groups slide, and none here slides by a window of {window.sliding_window}")
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "window", window)

    @classmethod
    def uniform(cls, window: WindowPolicy | None) -> GroupPricing:
        """One group of every layer: a local one sliding by `window`, or a global one without it."""
        return cls(0, 1, window) if window is not None else cls(1, 0, None)

    @property
    def global_groups(self) -> int:
        """Groups of full-attention layers."""
        return sum(1 for kind in self.kinds if isinstance(kind, FullAttention))

    @property
    def local_groups(self) -> int:
        """Groups of sliding-window layers."""
        return sum(1 for kind in self.kinds if isinstance(kind, SlidingWindow))

    def hold(self, prompt_len: int, max_seq_len: int, block_size: int) -> GroupHold:
        """A row of `max_seq_len` (prompt + max_tokens) positions: its sliding groups slide only when that
        saves blocks (`window.row_hold`)."""
        sliding = row_hold(prompt_len, max_seq_len, block_size, self.window)
        return GroupHold(max_seq_len, sliding.positions, sliding.window,
                         self.blocks(max_seq_len, sliding.positions, block_size))

    def blocks(self, positions: int, held: int, block_size: int) -> int:
        """Blocks a row takes whose groups that slide by this pricing's window hold `held` positions and
        the others `positions`: each group's kind's lease, summed (what the store leases)."""
        return sum(lease_blocks(kind, self.window, positions, held, block_size) for kind in self.kinds)


def group_blocks(kind: CacheKind | bool, positions: int, held: int, block_size: int) -> int:
    """Blocks one group's lease takes when its kind holds `held` positions if it slides: a sliding
    window's (or a local group's, given a flag) `held`, a full-attention group's `positions`."""
    return as_kind(kind).blocks(positions, held, block_size)
