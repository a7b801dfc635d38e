"""`ForwardContext`: what one forward's blocks share, built once per forward by the decoder.

The inputs of each KV group (positions, slots, the decode group's tables, the prefill chunks), the
prefill plans the kernels run, the RoPE tables of each kind (and, off the kernels, each row's cos/sin),
and the store: a block reads what it needs and keeps nothing between forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
from ferrox_batch.runtime.kv.batch_inputs import BatchInputs
from ferrox_batch.runtime.kv.paged_kv import PagedKvStore
from ferrox_batch.runtime.kv.prefill_plan import PrefillPlan


@dataclass(slots=True)
class ForwardContext:
    kernels: CpuKernels | None
    store: PagedKvStore
    #: One set of inputs per KV group, and its prefill plan on the kernels (None: no prefill, or torch).
    groups: list[BatchInputs]
    plans: list[PrefillPlan | None]
    #: `(cos, sin)` `[positions, head_dim]` of each RoPE kind the layers use.
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    #: Off the kernels, each row's `(cos, sin)` `[rows, 1, head_dim]` of each kind; None on the kernels.
    rope_rows: dict[str, tuple[torch.Tensor, torch.Tensor]] | None
    #: Rows in the forward (every token of every chunk).
    rows: int
    eps: float
    #: Each row's per-layer inputs `[rows, layers, size]` (`per_layer_input`), where the model has them.
    layer_inputs: torch.Tensor | None = None
