"""A family's `LayerSpec` made into a `Layer`: the one place specs become blocks holding weights.

Each spec kind has its builder (`BUILDERS`); a new kind of mixer or feed-forward block adds its spec (in
`runtime.families.layer_spec`) and its builder here. Builders take the tensors the spec names from the
checkpoint (`Take`, which checks shapes and consumes them), ask the linear factory for their linears,
and make the weights the shape the kernels want: Q/K/V and gate/up fused, each head's dimensions
reordered where RoPE rotates only part of it, the family's norm offset added to its norms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import torch

from ferrox_batch.runtime.architectures.attention import HeadShape
from ferrox_batch.runtime.architectures.attention_mixer import AttentionMixer
from ferrox_batch.runtime.architectures.clamped_swiglu import ClampedSwiGlu
from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.gated_mlp import GatedMlp
from ferrox_batch.runtime.architectures.layer import Block, Layer
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.architectures.moe import MoeBlock
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear
from ferrox_batch.runtime.architectures.rope import reorder_heads, rotary_permutation
from ferrox_batch.runtime.families.layer_spec import AttentionSpec, GatedMlpSpec, LayerSpec
from ferrox_batch.runtime.families.moe_spec import EXPERT, ExpertLayout, MoeSpec, bias_name, expert_bias_name
from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.quant.weight import QuantizedWeight, Segment, Weight, cat_rows, reorder_rows, split_rows

class Take(Protocol):
    """The checkpoint, as blocks take their tensors out of it (`CheckpointTaker`)."""

    def __call__(self, name: str, shape: tuple[int, ...]) -> Weight:
        """The tensor `name`, its shape checked, in the decoder's format: a 2-D weight may come quantized."""
        ...

    def __contains__(self, name: str) -> bool:
        """Whether the checkpoint (still) holds `name`."""
        ...

    def float32(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name`, its shape checked, in float32 as stored."""
        ...

    def mxfp4(self, name: str, shape: tuple[int, int, int]) -> Weight:
        """The stacked weight `name` of `shape` stored as its published MXFP4 blocks and scales, in the
        decoder's format."""
        ...


class LinearMaker(Protocol):
    """What builds a block's linears in the decoder's weight format (the linear factory)."""

    def linear(self, weight: Weight, bias: torch.Tensor | None = None, *, keep_weight: bool = False,
               narrow: bool = True) -> Linear | QuantizedLinear:
        """A linear layer of `weight` (and `bias`); `narrow=False`: no narrow steps' copy."""
        ...

    def gate_up(self, weight: Weight, activation: str, *, narrow: bool = True) -> GateUp:
        """The fused gate/up projection of `weight` (gate rows, then up rows), gated by `activation`."""
        ...

    def experts(self, weight: Weight, bias: torch.Tensor | None = None) -> tuple[Linear | QuantizedLinear, ...]:
        """One linear per expert of a stacked `[experts, out, in]` weight."""
        ...

    def gate_up_experts(self, weight: Weight, activation: str) -> tuple[GateUp, ...]:
        """One gated projection per expert of a stacked `[experts, 2n, k]` gate/up weight."""
        ...


class _Parts:
    """What a block builder reads with: the checkpoint, the linear maker, the layer's prefix and index, and
    its norms (the family's offset added)."""

    __slots__ = ("index", "make", "offset", "prefix", "take")

    def __init__(self, take: Take, make: LinearMaker, prefix: str, index: int, offset: float) -> None:
        self.take, self.make, self.prefix, self.index, self.offset = take, make, prefix, index, offset

    def tensor(self, name: str, shape: tuple[int, ...]) -> Weight:
        return self.take(self.prefix + name, shape)

    def float32(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.take.float32(self.prefix + name, shape)

    def holds(self, name: str) -> bool:
        return self.prefix + name in self.take

    def norm(self, name: str | None, size: int) -> torch.Tensor | None:
        if name is None:
            return None
        weight = self.take(f"{self.prefix}{name}.weight", (size,))
        assert isinstance(weight, torch.Tensor)
        return weight + self.offset if self.offset else weight


def _attention(spec: AttentionSpec, parts: _Parts) -> AttentionMixer:
    s = spec
    q, kv, h, d = s.q_width, s.kv_width, s.hidden, s.head_dim
    widths = (q, kv, kv) if len(s.projections) == 3 else (q + 2 * kv,)
    qkv = cat_rows([parts.tensor(f"{name}.weight", (width, h)) for name, width in zip(s.projections, widths)]) \
        if len(widths) == 3 else parts.tensor(f"{s.projections[0]}.weight", (widths[0], h))
    bias = None
    if s.bias:
        bias = torch.cat([parts.tensor(f"{name}.bias", (width,)) for name, width in zip(s.projections, widths)])
    rotary = s.rotary_dim or d
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
        k_norm=parts.norm(s.k_norm, span or kv),
        qk_norm_span=s.qk_norm_span,
        out_norm=parts.norm(s.out_norm, h),
        sinks=None if s.sinks is None else parts.float32(s.sinks, (s.heads,)),
    )


def _gated_mlp(spec: GatedMlpSpec, parts: _Parts) -> GatedMlp:
    s = spec
    h, ff = s.hidden, s.intermediate
    if len(s.projections) == 2:
        weight = cat_rows([parts.tensor(f"{name}.weight", (ff, h)) for name in s.projections])
    else:
        weight = parts.tensor(f"{s.projections[0]}.weight", (2 * ff, h))
    return GatedMlp(gate_up=parts.make.gate_up(weight, s.activation),
                    down=parts.make.linear(parts.tensor(f"{s.down}.weight", (h, ff)), None),
                    out_norm=parts.norm(s.out_norm, h))


def _layout(spec: MoeSpec, parts: _Parts) -> ExpertLayout:
    """The first of the spec's layouts the checkpoint holds (the family's own where it holds none: its
    missing tensor is then the error)."""
    return next((layout for layout in spec.layouts if parts.holds(layout.marker())), spec.layouts[0])


def _stacked(parts: _Parts, name: str, experts: int, rows: int, cols: int, transposed: bool,
             mxfp4: bool = False) -> Weight:
    """A stacked `[experts, rows, cols]` expert weight, read as stored (`[experts, cols, rows]` where the
    layout is transposed, which only dense tensors may be; as its MXFP4 blocks and scales where `mxfp4`)."""
    if mxfp4:
        return parts.take.mxfp4(parts.prefix + name, (experts, rows, cols))
    if not transposed:
        return parts.tensor(name, (experts, rows, cols))
    weight = parts.tensor(name, (experts, cols, rows))
    if not isinstance(weight, torch.Tensor):
        raise ModelLoadError(f"tensor {name!r} is stored transposed, which quantized blocks cannot be")
    return weight.transpose(1, 2).contiguous()


def _deinterleave(weight: Weight, name: str) -> Weight:
    """Alternating gate, up rows (of each expert) made every gate row, then every up row: a quantized stack
    of one format moves its blocks' rows, each row stored on its own (never requantized)."""
    if isinstance(weight, QuantizedWeight) and weight.experts is not None and len(weight.segments) == 1:
        (segment,) = weight.segments
        rows = torch.cat([segment.data[:, 0::2], segment.data[:, 1::2]], dim=1).contiguous()
        return QuantizedWeight((Segment(segment.format, rows),), weight.cols)
    if not isinstance(weight, torch.Tensor):
        raise ModelLoadError(f"tensor {name!r} interleaves its gate and up rows, which quantized blocks cannot")
    return torch.cat([weight[..., 0::2, :], weight[..., 1::2, :]], dim=-2).contiguous() if weight.dim() == 3 else \
        torch.cat([weight[:, 0::2], weight[:, 1::2]], dim=-1).contiguous()


#: A layer's experts' weights: stacked `[experts, rows, cols]`, or one 2-D weight per expert.
ExpertWeights = Weight | list[Weight]


def _experts(spec: MoeSpec, layout: ExpertLayout, parts: _Parts) -> tuple[ExpertWeights, ExpertWeights,
                                                                       torch.Tensor | None, torch.Tensor | None]:
    """Every expert's gate/up (`2 * ff` rows, gate rows first) and down weights, as the layout stores them
    (stacked, or one per expert), and their stacked `[experts, 2 * ff]` and `[experts, hidden]` biases where
    the spec has them."""
    h, ff, count = spec.hidden, spec.intermediate, spec.router.experts

    def vector(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        value = parts.tensor(name, shape)
        assert isinstance(value, torch.Tensor)
        return value

    if layout.per_expert:
        def each(name: str, e: int) -> str:
            return name.replace(EXPERT, str(e))

        gate_up = [cat_rows([parts.tensor(each(name, e), (ff, h)) for name in layout.gate_up]) for e in range(count)]
        down = [parts.tensor(each(layout.down, e), (h, ff)) for e in range(count)]
        if not spec.bias:
            return gate_up, down, None, None
        return (gate_up, down,
                torch.stack([torch.cat([vector(expert_bias_name(each(name, e)), (ff,)) for name in layout.gate_up])
                             for e in range(count)]),
                torch.stack([vector(expert_bias_name(each(layout.down, e)), (h,)) for e in range(count)]))
    rows = 2 * ff if len(layout.gate_up) == 1 else ff
    stacked = cat_rows([_stacked(parts, name, count, rows, h, layout.transposed, layout.mxfp4)
                        for name in layout.gate_up])
    down_stacked = _stacked(parts, layout.down, count, h, ff, layout.transposed, layout.mxfp4)
    gate_up_bias = torch.cat([vector(expert_bias_name(name), (count, rows)) for name in layout.gate_up], dim=-1) \
        if spec.bias else None
    if layout.interleaved:
        stacked = _deinterleave(stacked, layout.gate_up[0])
        gate_up_bias = None if gate_up_bias is None else _deinterleave(gate_up_bias, layout.gate_up[0])
    return stacked, down_stacked, gate_up_bias, vector(expert_bias_name(layout.down), (count, h)) if spec.bias else None


def _expert_linears(make: LinearMaker, weights: ExpertWeights,
                    bias: torch.Tensor | None) -> tuple[Linear | QuantizedLinear, ...]:
    if isinstance(weights, list):
        return tuple(make.linear(w, None if bias is None else bias[e], narrow=False) for e, w in enumerate(weights))
    return make.experts(weights, bias)


def _moe(spec: MoeSpec, parts: _Parts) -> MoeBlock:
    s, r = spec, spec.router
    h, count = s.hidden, r.experts
    layout = _layout(s, parts)
    make = parts.make
    gate_up_weights, down_weights, gate_up_bias, down_bias = _experts(s, layout, parts)
    gate_up: tuple[GateUp | ClampedSwiGlu, ...]
    if s.clamp is not None:
        gate_up = tuple(ClampedSwiGlu(linear, s.clamp, s.intermediate)
                        for linear in _expert_linears(make, gate_up_weights, gate_up_bias))
    elif gate_up_bias is not None:
        raise ModelLoadError("biases on the experts' gate/up projections are read only with the clamped SwiGLU")
    elif isinstance(gate_up_weights, list):
        gate_up = tuple(make.gate_up(w, s.activation, narrow=False) for w in gate_up_weights)
    else:
        gate_up = make.gate_up_experts(gate_up_weights, s.activation)
    return MoeBlock(
        router=r,
        router_weight=parts.float32(layout.router, (count, h)),
        router_bias=parts.float32(bias_name(layout.router), (count,)) if r.bias else None,
        correction=None if r.correction_bias is None else parts.float32(r.correction_bias, (count,)),
        gate_up=gate_up,
        down=_expert_linears(make, down_weights, down_bias),
        shared=None if s.shared is None else _gated_mlp(s.shared, parts),
        shared_gate=None if s.shared_gate is None else parts.float32(s.shared_gate, (1, h)),
        out_norm=parts.norm(s.out_norm, h),
    )


#: Each spec kind's builder.
BUILDERS: Mapping[type, Callable[[Any, _Parts], Block]] = MappingProxyType({
    AttentionSpec: _attention,
    GatedMlpSpec: _gated_mlp,
    MoeSpec: _moe,
})


def build_layer(spec: LayerSpec, index: int, take: Take, make: LinearMaker, norm_offset: float = 0.0) -> Layer:
    """Layer `index` from its spec (`norm_offset`: the family's, added to every norm it reads)."""
    parts = _Parts(take, make, spec.prefix, index, norm_offset)
    return Layer(
        mixer=BUILDERS[type(spec.mixer)](spec.mixer, parts),
        ffn=BUILDERS[type(spec.ffn)](spec.ffn, parts),
        input_norm=parts.norm(spec.input_norm, spec.hidden),
        post_norm=parts.norm(spec.post_norm, spec.hidden),
        residual_scale=spec.residual_scale,
    )
