"""A family's `LayerSpec` made into a `Layer`: the one place specs become blocks holding weights.

Each spec kind has its builder (`BUILDERS`); a new kind of mixer or feed-forward block adds its spec (in
`runtime.families.layer_spec`) and its builder here. Builders take the tensors the spec names from the
checkpoint (`block_parts.Take`, which checks shapes and consumes them), ask the linear factory for their linears,
and make the weights the shape the kernels want: Q/K/V and gate/up fused, each head's dimensions
reordered where RoPE rotates only part of it, the family's norm offset added to its norms. A mixture of
experts' reading of its many tensors is its own module's (`moe_builder`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from ferrox_batch.runtime.architectures.attention import HeadShape
from ferrox_batch.runtime.architectures.attention_mixer import AttentionMixer
from ferrox_batch.runtime.architectures.block_parts import BlockParts, LinearMaker, Take
from ferrox_batch.runtime.architectures.gated_mlp import GatedMlp
from ferrox_batch.runtime.architectures.layer import Block, Layer
from ferrox_batch.runtime.architectures.moe_builder import build_moe
from ferrox_batch.runtime.architectures.parallel_ffn import ParallelFfn
from ferrox_batch.runtime.architectures.per_layer_input import PerLayerInput
from ferrox_batch.runtime.architectures.rope import reorder_heads, rotary_permutation
from ferrox_batch.runtime.families.layer_spec import (AttentionSpec, GatedMlpSpec, LayerSpec, ParallelFfnSpec,
                                                      PerLayerInputSpec)
from ferrox_batch.runtime.families.moe_spec import MoeSpec
from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.quant.weight import cat_rows, reorder_rows, split_rows


def _attention(spec: AttentionSpec, parts: BlockParts) -> AttentionMixer:
    s = spec
    q, kv, h, d = s.q_width, s.kv_width, s.hidden, s.head_dim
    for name, shape in s.unread:
        if parts.holds(name):
            parts.tensor(name, shape)
    widths = s.projection_widths()
    taken = [parts.tensor(f"{name}.weight", (width, h)) for name, width in zip(s.projections, widths)]
    if s.v_from_k:  # the values are the keys' projection, taken once and held twice: one fused product
        taken.append(taken[1])
    qkv = cat_rows(taken) if len(taken) > 1 else taken[0]
    bias = None
    if s.bias:
        if s.v_from_k or not s.writes_kv:
            raise ModelLoadError("biases are read only on separate or stacked Q/K/V projections")
        bias = torch.cat([parts.tensor(f"{name}.bias", (width,)) for name, width in zip(s.projections, widths)])
    rotary = s.rotary_dim or d
    if rotary < d and not s.writes_kv:
        raise ModelLoadError("partial rotation is read only on layers that write their own K/V")
    if rotary < d:
        # Each query and key head's rotated pairs moved where a full rotation puts them; the RoPE tables
        # pass the rest through (`rope`).
        order = rotary_permutation(d, rotary)
        qs, ks, vs = split_rows(qkv, (q, kv, kv))
        qkv = cat_rows([reorder_rows(qs, lambda rows: reorder_heads(rows, s.heads, d, order)),
                        reorder_rows(ks, lambda rows: reorder_heads(rows, s.kv_heads, d, order)), vs])
        if bias is not None:
            bias = torch.cat([reorder_heads(bias[:q], s.heads, d, order),
                              reorder_heads(bias[q:q + kv], s.kv_heads, d, order), bias[q + kv:]])
    span = d if s.qk_norm_span == "head" else None
    return AttentionMixer(
        layer=parts.index,
        shape=HeadShape(s.heads, s.kv_heads, d, s.scale),
        qkv=parts.make.linear(qkv, bias),
        o=parts.make.linear(parts.tensor(f"{s.output}.weight", (h, q)),
                            parts.tensor(f"{s.output}.bias", (h,)) if s.output_bias else None),
        rope=s.rope,
        window=s.window,
        q_norm=parts.norm(s.q_norm, span or q),
        k_norm=parts.norm(s.k_norm, span or kv) if s.writes_kv else None,
        qk_norm_span=s.qk_norm_span,
        out_norm=parts.norm(s.out_norm, h),
        sinks=None if s.sinks is None else parts.float32(s.sinks, (s.heads,)),
        v_norm=torch.ones(d) if s.v_norm else None,  # a scale of one: exact in any dtype
        writes_kv=s.writes_kv,
    )


def _gated_mlp(spec: GatedMlpSpec, parts: BlockParts) -> GatedMlp:
    s = spec
    h, ff = s.hidden, s.intermediate
    if len(s.projections) == 2:
        weight = cat_rows([parts.tensor(f"{name}.weight", (ff, h)) for name in s.projections])
    else:
        weight = parts.tensor(f"{s.projections[0]}.weight", (2 * ff, h))
    return GatedMlp(gate_up=parts.make.gate_up(weight, s.activation),
                    down=parts.make.linear(parts.tensor(f"{s.down}.weight", (h, ff)), None),
                    out_norm=parts.norm(s.out_norm, h))


def _parallel_ffn(spec: ParallelFfnSpec, parts: BlockParts) -> ParallelFfn:
    return ParallelFfn(tuple(BUILDERS[type(branch)](branch, parts) for branch in spec.branches),
                       tuple(parts.norm(name, spec.hidden) for name in spec.in_norms),
                       parts.norm(spec.out_norm, spec.hidden))


def _per_layer_input(spec: PerLayerInputSpec, parts: BlockParts) -> PerLayerInput:
    s = spec
    norm = parts.norm(s.out_norm, s.hidden)
    assert norm is not None
    return PerLayerInput(parts.index, parts.make.linear(parts.tensor(f"{s.gate}.weight", (s.size, s.hidden))),
                         parts.make.linear(parts.tensor(f"{s.projection}.weight", (s.hidden, s.size))), norm)


#: Each spec kind's builder.
BUILDERS: Mapping[type, Callable[[Any, BlockParts], Block]] = MappingProxyType({
    AttentionSpec: _attention,
    GatedMlpSpec: _gated_mlp,
    MoeSpec: lambda spec, parts: build_moe(spec, parts, _gated_mlp),
    PerLayerInputSpec: _per_layer_input,
    ParallelFfnSpec: _parallel_ffn,
})


def build_layer(spec: LayerSpec, index: int, take: Take, make: LinearMaker, norm_offset: float = 0.0) -> Layer:
    """Layer `index` from its spec (`norm_offset`: the family's, added to every norm it reads)."""
    parts = BlockParts(take, make, spec.prefix, index, norm_offset)
    return Layer(
        mixer=BUILDERS[type(spec.mixer)](spec.mixer, parts),
        ffn=BUILDERS[type(spec.ffn)](spec.ffn, parts),
        input_norm=parts.norm(spec.input_norm, spec.hidden),
        post_norm=parts.norm(spec.post_norm, spec.hidden),
        residual_scale=spec.residual_scale,
        after=None if spec.after is None else BUILDERS[type(spec.after)](spec.after, parts),
        output_scale=None if spec.output_scale is None else parts.vector(spec.output_scale, (1,)),
    )


