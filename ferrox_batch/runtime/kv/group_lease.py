"""One sequence's KV lease over the store's groups: a block table per group, ordinary or sliding.

A store of a model whose layers differ in window (`admission.kv_groups`) holds each sequence in every
group: a global group's table maps each of its pages to a block for the lease's life, a local group's
slides (`runtime.kv.sliding.SlidingPages`) when the row was priced at its hold bound. All of a sequence's
local groups slide in lockstep (same writes, same policy, same number of blocks), so their tables always
have the same shape and the same released pages; only the block ids differ.

`SeqKv.blocks` is every block of every group (what the ledger counts); `table` and `sliding` are the first
group's, which for a model of one kind of layer is the only one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import torch

from ferrox_batch.runtime.kv.sliding import SlidingPages


@dataclass(slots=True)
class GroupTable:
    """One group's lease: its blocks (fixed for the lease's life), the table of its pages, and how those
    slide (None: every page keeps its block)."""

    blocks: list[int]
    table: torch.Tensor
    sliding: SlidingPages | None = None


@dataclass(slots=True)
class SeqKv:
    """One sequence's block tables and how many positions it has written (adopted ones included).

    `capacity` is what a group that keeps every position holds; a sliding group writes past it."""

    groups: list[GroupTable]
    capacity: int
    length: int = 0
    salt: str | None = None  # the prefix-cache namespace it adopts from and publishes to
    blocks: list[int] = field(default_factory=list)  # every group's blocks, in group order

    def __post_init__(self) -> None:
        if not self.blocks:
            self.blocks = [block for group in self.groups for block in group.blocks]

    @property
    def table(self) -> torch.Tensor:
        """The first group's table (a model of one kind of layer has only that one)."""
        return self.groups[0].table

    @property
    def sliding(self) -> SlidingPages | None:
        """How the sequence's local groups slide (they slide together), or None when none does."""
        return next((group.sliding for group in self.groups if group.sliding is not None), None)

    def before_write(self, seq_id: Hashable, count: int, device: torch.device) -> None:
        """Make room for the next `count` positions: the sliding groups slide and install their pages, the
        others must hold them already. Raises ValueError, changing nothing, past what the lease holds."""
        end = self.length + count
        if end > self.capacity and any(group.sliding is None for group in self.groups):
            raise ValueError(f"sequence {seq_id!r} would reach {end} positions but its KV lease holds {self.capacity}")
        sliding = [group for group in self.groups if group.sliding is not None]
        changed: list[bool] = []
        for index, group in enumerate(sliding):
            assert group.sliding is not None
            try:
                changed.append(group.sliding.before_write(self.length, count))
            except ValueError as short:
                # The groups slide in lockstep: the first one refuses before any of them changed.
                assert index == 0
                raise ValueError(f"sequence {seq_id!r} {short}") from None
        for group, moved in zip(sliding, changed):
            assert group.sliding is not None
            # Also when an earlier rebuild failed part way: a table short of pages must never be read.
            if moved or group.table.numel() != len(group.sliding.pages):
                group.table = torch.tensor(group.sliding.pages, dtype=torch.long, device=device)
