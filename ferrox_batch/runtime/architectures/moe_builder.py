"""A mixture of experts' weights read from a checkpoint in whichever layout it stores them, and its block.

The spec lists the layouts its family's checkpoints come in (`families.moe_spec.ExpertLayout`); the first
the checkpoint holds is read: one 2-D tensor per expert and projection, or stacked 3-D tensors (one gate/up
tensor, transposed or with gate and up rows interleaved, or one per projection), with biases where the spec
has them. The experts' linears come from the linear factory (stacked weights one layer per expert, quantized
blocks as stored), and where every one is the int8 kernel's they also run together (`moe.packed_experts`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferrox_batch.runtime.architectures.block_parts import BlockParts, LinearMaker
from ferrox_batch.runtime.architectures.clamped_swiglu import ClampedSwiGlu
from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.gated_mlp import GatedMlp
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.architectures.moe import MoeBlock, fused_experts, packed_experts, plain_router
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear
from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.families.layer_spec import GatedMlpSpec
from ferrox_batch.runtime.families.moe_spec import EXPERT, ExpertLayout, MoeSpec, bias_name, expert_bias_name
from ferrox_batch.runtime.quant.weight import QuantizedWeight, Segment, Weight, cat_rows


def _layout(spec: MoeSpec, parts: BlockParts) -> ExpertLayout:
    """The first of the spec's layouts the checkpoint holds (the family's own where it holds none: its
    missing tensor is then the error)."""
    return next((layout for layout in spec.layouts if parts.holds(layout.marker())), spec.layouts[0])


def _stacked(parts: BlockParts, name: str, experts: int, rows: int, cols: int, transposed: bool,
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


def _experts(spec: MoeSpec, layout: ExpertLayout, parts: BlockParts) -> tuple[ExpertWeights, ExpertWeights,
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


def build_moe(spec: MoeSpec, parts: BlockParts, gated_mlp: Callable[[GatedMlpSpec, BlockParts], GatedMlp]) -> MoeBlock:
    """The block `spec` describes, read through `parts`; `gated_mlp` builds its shared expert."""
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
    down = _expert_linears(make, down_weights, down_bias)
    packed = packed_experts(gate_up, down)
    router_weight = parts.float32(layout.router, (count, h))
    return MoeBlock(
        packed=packed,
        fused=fused_experts(packed, r, router_weight),
        plain_router=plain_router(r),
        router=r,
        router_weight=router_weight,
        router_bias=parts.float32(bias_name(layout.router), (count,)) if r.bias else None,
        correction=None if r.correction_bias is None else parts.float32(r.correction_bias, (count,)),
        gate_up=gate_up,
        down=down,
        shared=None if s.shared is None else gated_mlp(s.shared, parts),
        shared_gate=None if s.shared_gate is None else parts.float32(s.shared_gate, (1, h)),
        out_norm=parts.norm(s.out_norm, h),
        router_input_scale=None if r.input_scale is None else parts.float32(r.input_scale, (h,)),
        expert_scale=None if r.expert_scale is None else parts.float32(r.expert_scale, (count,)),
        expert_norm=parts.norm(s.expert_norm, h),
    )


