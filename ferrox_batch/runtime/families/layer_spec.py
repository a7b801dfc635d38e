"""What one decoder layer is made of, as data: which shared blocks, over which of the checkpoint's tensors.

A family module says how its layer `i` is built by returning a `LayerSpec`: a mixer (today attention, with
its projections fused or not, biases, per-head or whole-projection norms on its queries and keys, its RoPE
kind, window and scale, a norm on its output) and a feed-forward block (the gated MLP, or a mixture of
experts: `families.moe_spec`), the norms
before each, and a multiplier on what each adds to the residual stream. The runtime turns a spec into the
blocks that hold and run the weights (`runtime.architectures.layer_builder`); the GGUF reader and the test
fixtures read the same spec for the tensors a checkpoint must hold (`tensors`), so no family's tensor names
or shapes are written down twice.

A new kind of mixer or feed-forward block is a new spec class here and a builder for it there. These are
torch-free values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

#: Where a norm on the queries and keys reaches: each head over its `head_dim` (Qwen3, Gemma 3), or the
#: whole projection at once (OLMo 2).
QkNormSpan = Literal["head", "projection"]


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """Attention over the paged KV cache. Tensor names follow the layer's prefix (`self_attn.q_proj`)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    #: The Q, K and V projections' names, in that order, or one name holding the three stacked (Phi-3).
    projections: tuple[str, ...]
    output: str
    #: Scores are multiplied by this before the softmax.
    scale: float
    #: Which RoPE tables the layer rotates by: "global", "local" (the windowed layers' own base) or "none".
    rope: str = "global"
    #: How many of each head's dimensions RoPE rotates (the rest pass through); None: all of them.
    rotary_dim: int | None = None
    #: The last positions the layer attends over, itself included; None: every position.
    window: int | None = None
    #: The projections carry biases (`<name>.bias`).
    bias: bool = False
    #: RMSNorm weights on the queries and keys before RoPE, and how far each reaches.
    q_norm: str | None = None
    k_norm: str | None = None
    qk_norm_span: QkNormSpan = "head"
    #: An RMSNorm on the attention's output, before it joins the residual stream (Gemma 3, OLMo 2).
    out_norm: str | None = None
    #: The output projection carries a bias (gpt-oss).
    output_bias: bool = False
    #: A `[heads]` tensor of attention sinks: a logit per query head in each softmax's denominator (gpt-oss).
    sinks: str | None = None
    #: The values are RMS-normed per head without a scale (Gemma 4).
    v_norm: bool = False
    #: The values are the key projection's output, before its norm and RoPE: `projections` names Q and K
    #: alone (Gemma 4's global layers, `attention_k_eq_v`).
    v_from_k: bool = False
    #: Whether the layer projects and writes K/V of its own; False: `projections` names Q alone and it
    #: attends over another layer's K/V (`ModelConfig.kv_source`).
    writes_kv: bool = True
    #: Tensors a checkpoint may hold for the layer that it does not read, with their shapes (a layer that
    #: attends over another's K/V may still carry K/V projections): taken and dropped where present.
    unread: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def projection_widths(self) -> tuple[int, ...]:
        """The rows of each tensor `projections` names, in order."""
        q, kv = self.q_width, self.kv_width
        if not self.writes_kv:
            return (q,)
        if self.v_from_k:
            return (q, kv)
        return (q, kv, kv) if len(self.projections) == 3 else (q + 2 * kv,)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def tensors(self) -> dict[str, tuple[int, ...]]:
        q, kv, h = self.q_width, self.kv_width, self.hidden
        out: dict[str, tuple[int, ...]] = {}
        widths = self.projection_widths()
        for name, width in zip(self.projections, widths, strict=True):
            out[f"{name}.weight"] = (width, h)
            if self.bias:
                out[f"{name}.bias"] = (width,)
        out[f"{self.output}.weight"] = (h, q)
        if self.output_bias:
            out[f"{self.output}.bias"] = (h,)
        if self.sinks is not None:
            out[self.sinks] = (self.heads,)
        span = self.head_dim if self.qk_norm_span == "head" else None
        if self.q_norm is not None:
            out[f"{self.q_norm}.weight"] = (span or q,)
        if self.k_norm is not None and self.writes_kv:
            out[f"{self.k_norm}.weight"] = (span or kv,)
        if self.out_norm is not None:
            out[f"{self.out_norm}.weight"] = (h,)
        return out


@dataclass(frozen=True, slots=True)
class GatedMlpSpec:
    """The gated MLP: `down(act(gate(x)) * up(x))`."""

    hidden: int
    intermediate: int
    #: The gate and up projections' names, in that order, or one name holding both stacked (Phi-3).
    projections: tuple[str, ...]
    down: str
    #: The gate's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU).
    activation: str = "silu"
    #: An RMSNorm on the MLP's output, before it joins the residual stream (Gemma 3, OLMo 2).
    out_norm: str | None = None

    def tensors(self) -> dict[str, tuple[int, ...]]:
        h, ff = self.hidden, self.intermediate
        rows = (ff, ff) if len(self.projections) == 2 else (2 * ff,)
        out: dict[str, tuple[int, ...]] = {f"{name}.weight": (width, h)
                                           for name, width in zip(self.projections, rows, strict=True)}
        out[f"{self.down}.weight"] = (h, ff)
        if self.out_norm is not None:
            out[f"{self.out_norm}.weight"] = (h,)
        return out


@dataclass(frozen=True, slots=True)
class PerLayerInputSpec:
    """The layer's own input (`size` wide), gated by its residual stream after the feed-forward block:
    `norm(projection(gelu(gate(h)) * input))`, added to the stream (Gemma 4)."""

    hidden: int
    size: int
    gate: str
    projection: str
    out_norm: str

    def tensors(self) -> dict[str, tuple[int, ...]]:
        return {f"{self.gate}.weight": (self.size, self.hidden), f"{self.projection}.weight": (self.hidden, self.size),
                f"{self.out_norm}.weight": (self.hidden,)}


class BlockSpec(Protocol):
    """A mixer's or a feed-forward block's spec: the tensors it reads, after the layer's prefix."""

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's name and shape."""
        ...


class FeedForwardSpec(BlockSpec, Protocol):
    """A feed-forward block's spec: the dense `GatedMlpSpec`, or a mixture of experts (`moe_spec.MoeSpec`)."""

    @property
    def out_norm(self) -> str | None:
        """The RMSNorm on its output, where it has one."""
        ...


@dataclass(frozen=True, slots=True)
class ParallelFfnSpec:
    """Feed-forward blocks side by side over one input, each behind its own RMSNorm (None: the input as it
    came), their outputs summed, then normed (Gemma 4's dense MLP beside its mixture of experts)."""

    hidden: int
    branches: tuple[FeedForwardSpec, ...]
    in_norms: tuple[str | None, ...]
    out_norm: str | None = None

    def __post_init__(self) -> None:
        if len(self.branches) != len(self.in_norms) or not self.branches:
            raise ValueError("parallel feed-forward blocks need one input norm (or None) per branch")

    def tensors(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for branch in self.branches:
            out.update(branch.tensors())
        for norm in (*self.in_norms, self.out_norm):
            if norm is not None:
                out[f"{norm}.weight"] = (self.hidden,)
        return out

    def norm_names(self) -> tuple[str, ...]:
        """Every RMSNorm it and its branches hold (without the layer's prefix)."""
        names = [*self.in_norms, self.out_norm]
        for branch in self.branches:
            names += [branch.out_norm, getattr(branch, "expert_norm", None)]
        return tuple(name for name in names if name is not None)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One decoder layer: `h += scale * mixer(norm(h))`, then `h += scale * ffn(norm(h))`."""

    #: What every tensor name of the layer starts with (`model.layers.3.`).
    prefix: str
    hidden: int
    mixer: AttentionSpec
    #: The dense gated MLP, or a mixture of experts (`families.moe_spec`).
    ffn: FeedForwardSpec
    #: The RMSNorm before the mixer; None where the mixer reads the residual stream itself (OLMo 2).
    input_norm: str | None = "input_layernorm"
    #: The RMSNorm before the feed-forward block; None where it reads the residual stream itself.
    post_norm: str | None = "post_attention_layernorm"
    #: What each block's output is multiplied by before it joins the residual stream (Granite); None: 1.
    residual_scale: float | None = None
    #: A block after the feed-forward block, reading the residual stream itself (`PerLayerInputSpec`).
    after: PerLayerInputSpec | None = None
    #: A `[1]` tensor the residual stream is multiplied by at the layer's end (Gemma 4's `layer_scalar`).
    output_scale: str | None = None

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the layer, by its full name, at its shape in the checkpoint."""
        out: dict[str, tuple[int, ...]] = {}
        for norm in (self.input_norm, self.post_norm):
            if norm is not None:
                out[f"{norm}.weight"] = (self.hidden,)
        out.update(self.mixer.tensors())
        out.update(self.ffn.tensors())
        if self.after is not None:
            out.update(self.after.tensors())
        if self.output_scale is not None:
            out[self.output_scale] = (1,)
        return {self.prefix + name: shape for name, shape in out.items()}

    def norm_names(self) -> tuple[str, ...]:
        """The full names of the layer's RMSNorm weights (what a family's norm offset applies to)."""
        k_norm = self.mixer.k_norm if self.mixer.writes_kv else None
        names = [self.input_norm, self.post_norm, self.mixer.q_norm, k_norm, self.mixer.out_norm, self.ffn.out_norm,
                 None if self.after is None else self.after.out_norm, getattr(self.ffn, "expert_norm", None)]
        if isinstance(self.ffn, ParallelFfnSpec):
            names += self.ffn.norm_names()
        return tuple(f"{self.prefix}{name}.weight" for name in names if name is not None)
