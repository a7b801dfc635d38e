"""KV groups: a model's layers split into groups of one kind each, and what a row costs over them.

A model whose layers differ in how far back they attend (Gemma 3: five local layers, over the last
`window` positions, to one global layer) keeps every position only in its global layers; its local layers
read their window alone, so a lease may slide their pages (`admission.window`) while the global layers
keep every position. One pool of uniform blocks serves both kinds: the layers are split into groups of
`size` layers of one kind, and one block holds `size` layers' K/V for `block_size` positions. Each
sequence holds one block table per group, ordinary in a global group, sliding in a local one.

The grouping rule: `size` is the smaller of the two kinds' layer counts (a model of one kind is one group
of all its layers, exactly the layout of a store without groups), and a kind whose count it does not
divide pads its last group. That keeps the number of groups, and with it the per-forward work and the
tables each sequence keeps, near `layers / size`, at the cost of at most `size - 1` unused layer slots
per kind; for the Gemma 3 checkpoints whose global count divides the local one (270M: 15 and 3, 12B: 40
and 8) nothing is padded.

The pricing, `GroupPricing`, is the one place the ledger and the store agree on: a row costs
`global_groups * blocks_for(prompt + max_tokens) + local_groups * blocks_for(hold)`, the hold from
`window.row_hold`. Pure Python over ints (no torch): the handle prices with it on the caller's thread,
and the store leases exactly what it prices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ferrox_batch.admission.block_budget import blocks_for
from ferrox_batch.admission.window import WindowPolicy, row_hold
from ferrox_batch.checks import check_int


@dataclass(frozen=True, slots=True)
class KvGroups:
    """Which layers each group holds (`layers[k]`, at most `size` of them, in slot order), whether it
    is local (`local[k]`: its layers attend over the model's window only), and, derived from `layers`,
    where each layer lives (`slots[i]`: `(group, index within it)`, read once per layer of every forward)."""

    size: int
    layers: tuple[tuple[int, ...], ...]
    local: tuple[bool, ...]
    slots: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        where = {layer: (group, index) for group, members in enumerate(self.layers)
                 for index, layer in enumerate(members)}
        object.__setattr__(self, "slots", tuple(where[layer] for layer in range(len(where))))

    @classmethod
    def of(cls, local_layers: Sequence[bool]) -> KvGroups:
        """The groups of a model whose layer `i` is local when `local_layers[i]` (module docstring)."""
        if not local_layers:
            raise ValueError("a model has at least one layer")
        kinds = {kind: [i for i, local in enumerate(local_layers) if bool(local) == kind] for kind in (False, True)}
        present = [kind for kind in (False, True) if kinds[kind]]
        size = min(len(kinds[kind]) for kind in present)
        layers: list[tuple[int, ...]] = []
        local: list[bool] = []
        for kind in present:  # the global groups first
            members = kinds[kind]
            for start in range(0, len(members), size):
                layers.append(tuple(members[start:start + size]))
                local.append(kind)
        return cls(size, tuple(layers), tuple(local))

    @property
    def global_groups(self) -> int:
        return sum(1 for local in self.local if not local)

    @property
    def local_groups(self) -> int:
        return sum(1 for local in self.local if local)

    def slot(self, layer: int) -> tuple[int, int]:
        """`(group, index within its group)` of `layer`: it reads and writes `pool[index]` through that
        group's tables."""
        if not 0 <= layer < len(self.slots):
            raise ValueError(f"layer {layer} is in no KV group")
        return self.slots[layer]

    def pricing(self, window: WindowPolicy | None) -> GroupPricing:
        """What a row costs over these groups when its local groups slide by `window` (None: no group
        slides; a model without local layers never does)."""
        return GroupPricing(self.global_groups, self.local_groups, window if self.local_groups else None)


@dataclass(frozen=True, slots=True)
class GroupHold:
    """What admission prices a row at: `positions` held at once by each group that keeps every position
    (prompt + max_tokens), `held` by each local group (its hold bound when it slides, else `positions`),
    `window` the policy its local groups slide by (None: none slides), and the blocks all that takes."""

    positions: int
    held: int
    window: WindowPolicy | None
    blocks: int


@dataclass(frozen=True, slots=True)
class GroupPricing:
    """The group counts and the slide policy of the local groups: the row arithmetic of the ledger and
    the store (module docstring). `GroupPricing(1, 0, None)` is a store without windows."""

    global_groups: int
    local_groups: int
    window: WindowPolicy | None = None

    def __post_init__(self) -> None:
        check_int("global_groups", self.global_groups)
        check_int("local_groups", self.local_groups)
        if self.global_groups + self.local_groups < 1:
            raise ValueError("a store has at least one KV group")
        if self.window is not None and not self.local_groups:
            raise ValueError("only local groups slide")

    @classmethod
    def uniform(cls, window: WindowPolicy | None) -> GroupPricing:
        """One group of every layer: a local one sliding by `window`, or a global one without it."""
        return cls(0, 1, window) if window is not None else cls(1, 0, None)

    def hold(self, prompt_len: int, max_seq_len: int, block_size: int) -> GroupHold:
        """A row of `max_seq_len` (prompt + max_tokens) positions: its local groups slide only when that
        saves blocks (`window.row_hold`)."""
        local = row_hold(prompt_len, max_seq_len, block_size, self.window if self.local_groups else None)
        return GroupHold(max_seq_len, local.positions, local.window,
                         self.blocks(max_seq_len, local.positions, block_size))

    def blocks(self, positions: int, held: int, block_size: int) -> int:
        """Blocks a row takes whose global groups hold `positions` and local ones `held` (the store's
        lease: `group_blocks` summed)."""
        return (self.global_groups * group_blocks(False, positions, held, block_size)
                + self.local_groups * group_blocks(True, positions, held, block_size))


def group_blocks(local: bool, positions: int, held: int, block_size: int) -> int:
    """Blocks one group's lease takes: a local group's `held` positions, a global group's `positions`."""
    return blocks_for(held if local else positions, block_size)
