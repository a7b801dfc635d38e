"""`AttentionMixer`: attention over the paged KV store as a layer's mixer.

It holds the fused Q/K/V projection (with biases where the checkpoint has them), the output projection,
the optional RMSNorms on queries and keys (each head over its size, or the whole projection) and on values
(each head, unscaled), its RoPE kind, window and scale, its attention sinks where it has them, and the
optional norm on its output. `forward` rotates q and k, writes K/V to its KV group's pages, attends the
decode group and the prefill chunks (`attention`), projects and returns the output, `[rows, hidden]`. On
the CPU the C kernels rotate and store in one pass and attend in place. A layer that shares an earlier
layer's K/V projects only its queries, rotates them and attends over that layer's pool, writing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrox_batch.admission.cache_kinds import CacheKind, layer_kind
from ferrox_batch.runtime.architectures.attention import HeadShape, attend_decode, attend_prefill
from ferrox_batch.runtime.architectures.forward_context import ForwardContext
from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.architectures.norms import norm, norm_rows_in_place
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear
from ferrox_batch.runtime.architectures.rope import apply_rope
from ferrox_batch.runtime.families.layer_spec import QkNormSpan


@dataclass(slots=True)
class AttentionMixer:
    #: The layer's index: where its K/V live (`store.groups.slots`).
    layer: int
    shape: HeadShape
    qkv: Linear | QuantizedLinear
    o: Linear | QuantizedLinear
    rope: str = "global"
    window: int | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_norm_span: QkNormSpan = "head"
    out_norm: torch.Tensor | None = None
    #: Each query head's attention sink, float32 `[heads]` (`attention`), where the layer has them.
    sinks: torch.Tensor | None = None
    #: Ones `[head_dim]`: the values are RMS-normed per head, without a scale (Gemma 4); None: left as they are.
    v_norm: torch.Tensor | None = None
    #: Whether it projects and writes K/V of its own; False: its projection is the queries alone, and it
    #: attends over the K/V of the layer it shares (`PagedKvStore.layer_pool`).
    writes_kv: bool = True

    @property
    def plain(self) -> bool:
        """Whether it is the Llama layer's attention exactly (no norms of its own, global RoPE, the scale of
        its head size): what the C layer stack runs."""
        return (self.q_norm is None and self.k_norm is None and self.out_norm is None and self.rope == "global"
                and self.sinks is None and self.shape.attention_scale == self.shape.head_dim ** -0.5
                and self.v_norm is None and self.writes_kv)

    @property
    def plain_but_qk_norms(self) -> bool:
        """Whether it is `plain` but for RMS norms on its queries and keys (Qwen3, OLMo 2): what the C layer
        stack also runs."""
        return (self.out_norm is None and self.rope == "global" and self.sinks is None and self.v_norm is None
                and self.shape.attention_scale == self.shape.head_dim ** -0.5 and self.writes_kv)

    @property
    def cache_kind(self) -> CacheKind:
        """What its KV cache keeps per sequence: every position, or its window's (`store.groups` are built
        from the same rule)."""
        return layer_kind(self.window)

    #: Row by row wherever its linears are: attention reads each sequence's own keys (`Block.batch_invariant`).
    batch_invariant = True

    def linears(self) -> list[Linear | QuantizedLinear | GateUp]:
        return [self.qkv, self.o]

    def norms(self) -> list[torch.Tensor]:
        return [t for t in (self.q_norm, self.k_norm, self.out_norm) if t is not None]

    @property
    def nbytes(self) -> int:
        """Its weights' bytes: the projections as they store them, and its norms."""
        own = self.norms() + ([] if self.sinks is None else [self.sinks])
        return sum(linear.nbytes for linear in self.linears()) + sum(t.numel() * t.element_size() for t in own)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        s, kernel, n = self.shape, ctx.kernels, ctx.rows
        heads, kv_heads, d = s.num_heads, s.num_kv_heads, s.head_dim
        q_width, kv_width = heads * d, kv_heads * d
        qkv = self.qkv(x)
        # (start, width, weight, span): the queries and keys over a head or their whole projection, the
        # values over each head.
        norms = [(0, q_width, self.q_norm, d if self.qk_norm_span == "head" else q_width)]
        if self.writes_kv:
            norms += [(q_width, kv_width, self.k_norm, d if self.qk_norm_span == "head" else kv_width),
                      (q_width + kv_width, kv_width, self.v_norm, d)]
        for start, width, weight, span in norms:
            if weight is None:
                continue
            if kernel is not None and weight.dtype == qkv.dtype and qkv.is_contiguous():
                kernel.head_norms(qkv, start, width, span, weight, ctx.eps)  # what the C layer stack runs
            else:
                norm_rows_in_place(qkv[:, start:start + width], weight, span, ctx.eps)
        group, _ = ctx.store.layer_slot(self.layer)
        seen, plan = ctx.groups[group], ctx.plans[group]
        # The layer's K/V in every block, written and read through its group's tables (its source's, where
        # it shares another layer's).
        pool = ctx.store.layer_pool(self.layer)
        if not self.writes_kv:  # queries alone: rotated here, nothing written
            cos, sin = ctx.rope[self.rope]
            q = qkv.view(n, heads, d)
            if self.rope != "none":
                q = apply_rope(q, cos[seen.positions][:, None, :], sin[seen.positions][:, None, :])
        elif kernel is not None:  # RoPE in place and the K/V write, in one call
            cos, sin = ctx.rope[self.rope]
            kernel.rope_store(qkv, cos, sin, seen.positions, seen.slots, pool, heads, checked=True)
            q = qkv[:, :q_width].view(n, heads, d)
        else:
            assert ctx.rope_rows is not None
            # RoPE on q and k in one pass: their heads are adjacent in the fused projection.
            qk = qkv[:, : q_width + kv_width].view(n, heads + kv_heads, d)
            if self.rope != "none":
                qk = apply_rope(qk, *ctx.rope_rows[self.rope])
            q = qk[:, :heads]
            v = qkv[:, q_width + kv_width:].view(n, kv_heads, d)
            pool.index_copy_(0, seen.slots, torch.stack((qk[:, heads:], v), dim=1).to(pool.dtype))
        parts = []
        n_dec = 0
        if seen.decode is not None:
            n_dec = seen.decode.count
            parts.append(attend_decode(q[:n_dec], pool, seen.decode, ctx.store.block_size, s, kernel, self.sinks))
        if seen.prefill:
            parts.append(attend_prefill(q[n_dec:], pool, seen.prefill, s, kernel, plan, self.window, self.sinks))
        out = self.o(parts[0] if len(parts) == 1 else torch.cat(parts))
        if self.out_norm is not None:
            out = norm(out, self.out_norm, ctx.eps, kernel)
        return out
