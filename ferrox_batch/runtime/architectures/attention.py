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

A layer may have attention sinks (gpt-oss): a learned logit per query head that joins each softmax's
denominator and carries no value. The kernels take them as they are; for SDPA the context gets one more
key and value, both zero, whose score is the sink through an additive mask (`_with_sinks`).
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


def _with_sinks(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal_rows: int | None,
                sinks: torch.Tensor, sink_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V `[..., L, d]` with a zero key and value after the last, and the additive mask that gives that
    key each head's sink as its score: the boolean `mask` (`[..., L]`, None: every key; `causal_rows`: the
    causal mask of that many rows over as many keys) as 0 / -inf, then the sinks (`sink_shape`, heads where
    the scores' heads are, 1 elsewhere)."""
    zero = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    keys = k.shape[-2]
    if causal_rows is not None:
        mask = torch.ones(causal_rows, keys, dtype=torch.bool, device=k.device).tril()
    additive = torch.zeros(keys, dtype=k.dtype, device=k.device) if mask is None else \
        torch.zeros(mask.shape, dtype=k.dtype, device=k.device).masked_fill_(~mask, float("-inf"))
    sink = sinks.to(k.dtype).view(sink_shape)
    lead = torch.broadcast_shapes(additive.shape[:-1], sink.shape[:-1])
    full = torch.cat([additive.expand(*lead, keys), sink.expand(*lead, 1)], dim=-1)
    return torch.cat([k, zero], dim=-2), torch.cat([v, zero], dim=-2), full


def attend_decode(q: torch.Tensor, pool: torch.Tensor, group: DecodeGroup, block_size: int, shape: HeadShape,
                  kernels: CpuKernels | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The decode group's queries `[N, heads, head_dim]` over their contexts (`sinks`: the layer's float32
    `[heads]` attention sinks, where it has them)."""
    c = shape
    n = group.count
    qd = q.reshape(n, c.num_kv_heads, c.group_size, c.head_dim)
    if kernels is not None:  # the ranges were checked once per forward; build_inputs skipped the gather
        extra = {} if sinks is None else {"sinks": sinks}
        out = kernels.paged_decode(qd, pool, group.tables, group.lo, group.hi, block_size, c.attention_scale,
                                   ranges_checked=True, **extra)
    else:
        # Gather each sequence's K and V, `[N, kv_heads, L, head_dim]`, with one `index_select`;
        # the query heads that share a KV head are its "query length" (GQA without expansion).
        ctx = pool.index_select(0, group.ctx_slots).to(q.dtype).view(n, -1, 2, c.num_kv_heads, c.head_dim)
        k, v = ctx[:, :, 0].transpose(1, 2), ctx[:, :, 1].transpose(1, 2)
        mask = group.mask
        if sinks is not None:
            k, v, mask = _with_sinks(k, v, mask, None, sinks, (1, c.num_kv_heads, c.group_size, 1))
        out = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=c.attention_scale)
    return out.reshape(n, c.num_heads * c.head_dim)


def attend_prefill(q: torch.Tensor, pool: torch.Tensor, chunks: list[PrefillChunk], shape: HeadShape,
                   kernels: CpuKernels | None = None, plan: PrefillPlan | None = None,
                   window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The prefill chunks' queries `[rows, heads, head_dim]` (their rows in order) over their contexts: on
    the CPU one kernel call for every chunk (`plan`, its slots checked once per forward), elsewhere one
    SDPA call per chunk under the chunks' masks. `window` is the layer's (the kernel's key range; the
    chunks' masks already hold it); `sinks` as `attend_decode`'s."""
    c = shape
    if kernels is not None and plan is not None:
        extra = {} if sinks is None else {"sinks": sinks}
        return kernels.prefill_attention(q, pool, plan, c.attention_scale, window, plan_checked=True, **extra)
    outs = []
    row = 0
    for chunk in chunks:
        qc = q[row:row + chunk.length].transpose(0, 1)[None]  # [1, heads, len, hd]
        row += chunk.length
        ctx = pool.index_select(0, chunk.ctx_slots).to(q.dtype)  # [L, 2, kv, hd]
        k, v = ctx[:, 0].transpose(0, 1)[None], ctx[:, 1].transpose(0, 1)[None]  # [1, kv, L, hd]
        mask = chunk.mask
        if sinks is not None:
            k, v, mask = _with_sinks(k, v, mask, chunk.length if mask is None else None, sinks,
                                     (1, c.num_heads, 1, 1))
        out = F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=c.group_size > 1, scale=c.attention_scale)
        outs.append(out[0].transpose(0, 1).reshape(chunk.length, c.num_heads * c.head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
