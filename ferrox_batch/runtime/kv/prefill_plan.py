"""`PrefillPlan`: one forward's prompt chunks in the form the CPU prefill-attention kernel reads.

Built once per forward from the `batch_inputs.PrefillChunk`s and shared by every layer: the chunks'
context slots concatenated, and one row per chunk (its first query row among the prefill rows, its
rows, the positions before it, where its slots begin). The kernel (`csrc/prefill_attention.c`)
reads the pool through those slots unchecked, so `check` tests them against the pool once per
forward, as the decoder does for the decode group's block tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferrox_batch.runtime.kv.batch_inputs import PrefillChunk

#: Columns of `PrefillPlan.chunks`, in the kernel's order.
CHUNK_ROW, CHUNK_ROWS, CHUNK_START, CHUNK_SLOTS = range(4)


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    slots: torch.Tensor  # int64 [sum of the chunks' start + rows], contiguous, CPU
    chunks: torch.Tensor  # int64 [chunks, 4]: first row, rows, start, offset into `slots`
    rows: int  # query rows in all, the chunks' rows in order

    @classmethod
    def of(cls, chunks: Sequence[PrefillChunk]) -> PrefillPlan:
        if not chunks:
            raise ValueError("a prefill plan needs at least one chunk")
        table: list[tuple[int, int, int, int]] = []
        row = offset = 0
        for chunk in chunks:
            width = chunk.ctx_slots.numel()
            if chunk.length < 1 or width < chunk.length:
                raise ValueError(f"a chunk of {chunk.length} rows cannot attend to {width} positions")
            table.append((row, chunk.length, width - chunk.length, offset))
            row += chunk.length
            offset += width
        slots = torch.cat([chunk.ctx_slots for chunk in chunks]) if len(chunks) > 1 else chunks[0].ctx_slots
        return cls(slots.to(torch.int64).contiguous(), torch.tensor(table, dtype=torch.int64), row)

    def check(self, num_slots: int) -> None:
        """Raise unless the table is consistent and every slot lies inside a pool of `num_slots`."""
        t = self.chunks
        if (t.dtype != torch.int64 or t.dim() != 2 or t.shape[1] != 4 or not t.is_contiguous() or not t.is_cpu
                or self.slots.dtype != torch.int64 or not self.slots.is_cpu or not self.slots.is_contiguous()):
            raise ValueError("a prefill plan holds contiguous int64 CPU tensors, its chunks [n, 4]")
        if t.shape[0] == 0:
            raise ValueError("a prefill plan needs at least one chunk")
        rows, starts = t[:, CHUNK_ROWS], t[:, CHUNK_START]
        first_rows = torch.cat([torch.zeros(1, dtype=torch.int64), rows.cumsum(0)[:-1]])
        first_slots = torch.cat([torch.zeros(1, dtype=torch.int64), (starts + rows).cumsum(0)[:-1]])
        if (int(rows.min()) < 1 or int(starts.min()) < 0 or not torch.equal(t[:, CHUNK_ROW], first_rows)
                or not torch.equal(t[:, CHUNK_SLOTS], first_slots) or int(rows.sum()) != self.rows
                or int((starts + rows).sum()) != self.slots.numel()):
            raise ValueError("a prefill plan's chunk table does not match its rows and slots")
        if int(self.slots.min()) < 0 or int(self.slots.max()) >= num_slots:
            raise ValueError(f"a prefill chunk's slot is outside the KV pool's {num_slots}")
