"""Attention over the paged KV store, for the two groups of a varlen forward (`batch_inputs`).

* decode group: one query per sequence. On the CPU the C kernel reads K/V straight from the pool
  through each block table (`cpu_kernels`); elsewhere one `index_select` gathers every sequence's
  context and SDPA runs over it, with the query heads that share a KV head folded into the query
  axis (GQA without expanding K/V).
* prefill group: on the CPU one kernel call for all the chunks (`csrc/prefill_attention.c`: each
  chunk's keys and values widened once, then query rows x KV head tasks scored against them in
  registers); elsewhere one SDPA call per chunk, at its own length, over its own gathered context.

The pool may hold K/V narrower than the queries (an fp16 KV cache): the gathered context is widened
to the query's dtype before SDPA, and the kernel widens what it reads. Both functions return the
attention output flat, `[rows, heads * head_dim]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dataclasses import dataclass

from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
from ferrox_batch.runtime.kv.batch_inputs import DecodeGroup, PrefillChunk
from ferrox_batch.runtime.kv.prefill_plan import PrefillPlan


@dataclass(frozen=True, slots=True)
class HeadShape:
    """One attention layer's heads: how many query and KV heads, their size, and the scores' scale."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_scale: float

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads


def attend_decode(q: torch.Tensor, pool: torch.Tensor, group: DecodeGroup, block_size: int, shape: HeadShape,
                  kernels: CpuKernels | None) -> torch.Tensor:
    """The decode group's queries `[N, heads, head_dim]` over their contexts."""
    c = shape
    n = group.count
    qd = q.reshape(n, c.num_kv_heads, c.group_size, c.head_dim)
    if kernels is not None:  # the ranges were checked once per forward; build_inputs skipped the gather
        out = kernels.paged_decode(qd, pool, group.tables, group.lo, group.hi, block_size, c.attention_scale,
                                   ranges_checked=True)
    else:
        # Gather each sequence's K and V, `[N, kv_heads, L, head_dim]`, with one `index_select`;
        # the query heads that share a KV head are its "query length" (GQA without expansion).
        ctx = pool.index_select(0, group.ctx_slots).to(q.dtype).view(n, -1, 2, c.num_kv_heads, c.head_dim)
        k, v = ctx[:, :, 0].transpose(1, 2), ctx[:, :, 1].transpose(1, 2)
        out = F.scaled_dot_product_attention(qd, k, v, attn_mask=group.mask, scale=c.attention_scale)
    return out.reshape(n, c.num_heads * c.head_dim)


def attend_prefill(q: torch.Tensor, pool: torch.Tensor, chunks: list[PrefillChunk], shape: HeadShape,
                   kernels: CpuKernels | None = None, plan: PrefillPlan | None = None,
                   window: int | None = None) -> torch.Tensor:
    """The prefill chunks' queries `[rows, heads, head_dim]` (their rows in order) over their contexts: on
    the CPU one kernel call for every chunk (`plan`, its slots checked once per forward), elsewhere one
    SDPA call per chunk under the chunks' masks. `window` is the layer's (the kernel's key range; the
    chunks' masks already hold it)."""
    c = shape
    if kernels is not None and plan is not None:
        return kernels.prefill_attention(q, pool, plan, c.attention_scale, window, plan_checked=True)
    outs = []
    row = 0
    for chunk in chunks:
        qc = q[row:row + chunk.length].transpose(0, 1)[None]  # [1, heads, len, hd]
        row += chunk.length
        ctx = pool.index_select(0, chunk.ctx_slots).to(q.dtype)  # [L, 2, kv, hd]
        k, v = ctx[:, 0].transpose(0, 1)[None], ctx[:, 1].transpose(0, 1)[None]  # [1, kv, L, hd]
        out = F.scaled_dot_product_attention(qc, k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                             enable_gqa=c.group_size > 1, scale=c.attention_scale)
        outs.append(out[0].transpose(0, 1).reshape(chunk.length, c.num_heads * c.head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
