"""A mixture-of-experts feed-forward block, as data: its router, its experts and how a checkpoint stores them.

A family whose layer `i` is sparse returns a `MoeSpec` as that layer's feed-forward block, beside the
dense `GatedMlpSpec` of its other layers. The router scores every expert for each row and picks the
top k (`RouterSpec`: softmax scores, or sigmoid scores with a correction bias added for the choice alone
and the experts chosen group by group; renormalised over the k or not; scaled). Each expert is a gated
MLP of its own; a shared expert, gated by a sigmoid where the family has one, runs for every row.

Checkpoints store the experts in one of a few layouts (`ExpertLayout`): one 2-D tensor per expert and
projection (`experts.{e}.gate_proj.weight`: the layout most checkpoints are published in), one 3-D tensor
for the gate and up projections of every expert (`experts.gate_up_proj`: what transformers holds in
memory and some checkpoints are published in; gpt-oss's published ones hold it as MXFP4 blocks and
scales), or one 3-D tensor per projection (what llama.cpp's files hold). A spec lists the layouts its family's checkpoints come in, its own first: `tensors` names that
one, and the builder takes whichever the checkpoint holds. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.layer_spec import GatedMlpSpec

#: How the router turns each expert's logit into its score.
Scoring = Literal["softmax", "sigmoid"]
#: What a per-expert tensor's name holds in place of the expert's index.
EXPERT = "{e}"


@dataclass(frozen=True, slots=True)
class SwiGluClamp:
    """gpt-oss's SwiGLU settings (`swiglu_alpha`, `swiglu_limit`)."""

    alpha: float
    limit: float

    def __post_init__(self) -> None:
        if not (self.alpha > 0 and self.limit > 0):
            raise ModelLoadError(f"swiglu_alpha and swiglu_limit must be positive, got {self.alpha}, {self.limit}")


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """Which experts each row goes to, and with what weights (its weight's name is the layout's)."""

    experts: int
    top_k: int
    scoring: Scoring = "softmax"
    #: Divide the k chosen scores by their sum.
    renormalize: bool = False
    #: A `[experts]` tensor added to the scores for choosing the experts only (the weights stay the scores).
    correction_bias: str | None = None
    #: The experts fall in `groups` equal groups; only the best `topk_groups` groups' experts may be chosen,
    #: a group ranked by the sum of its two best scores (with the correction bias) or its best one.
    groups: int = 1
    topk_groups: int = 1
    #: What the chosen weights are multiplied by, after any renormalisation.
    scale: float = 1.0
    #: The router has a `[experts]` bias (the layout's router name with `.bias` for `.weight`).
    bias: bool = False
    #: The router reads its input RMS-normed without a scale (Gemma 4).
    input_norm: bool = False
    #: A `[hidden]` tensor the router's input is multiplied by, with `hidden ** -0.5` (Gemma 4).
    input_scale: str | None = None
    #: A `[experts]` tensor each chosen weight is multiplied by, after any renormalisation (Gemma 4).
    expert_scale: str | None = None

    def __post_init__(self) -> None:
        if self.experts <= 0:
            raise ModelLoadError(f"a mixture-of-experts layer needs experts, got {self.experts}")
        if not 0 < self.top_k <= self.experts:
            raise ModelLoadError(f"num_experts_per_tok is {self.top_k}: it must be between 1 and the "
                                 f"{self.experts} experts")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ModelLoadError(f"router scoring {self.scoring!r} is not supported (softmax or sigmoid)")
        if self.groups <= 0 or self.experts % self.groups:
            raise ModelLoadError(f"n_group {self.groups} does not divide the {self.experts} experts")
        if not 0 < self.topk_groups <= self.groups:
            raise ModelLoadError(f"topk_group {self.topk_groups} must be between 1 and n_group {self.groups}")
        if self.top_k > self.topk_groups * (self.experts // self.groups):
            raise ModelLoadError(f"num_experts_per_tok {self.top_k} is more than the {self.topk_groups} chosen "
                                 f"groups hold")

    def tensors(self, weight: str, hidden: int) -> dict[str, tuple[int, ...]]:
        """Its tensors, its weight named `weight`."""
        out: dict[str, tuple[int, ...]] = {weight: (self.experts, hidden)}
        if self.bias:
            out[bias_name(weight)] = (self.experts,)
        if self.correction_bias is not None:
            out[self.correction_bias] = (self.experts,)
        if self.input_scale is not None:
            out[self.input_scale] = (hidden,)
        if self.expert_scale is not None:
            out[self.expert_scale] = (self.experts,)
        return out


def bias_name(weight: str) -> str:
    """A weight's bias's name (`mlp.router.weight` -> `mlp.router.bias`)."""
    return weight.removesuffix(".weight") + ".bias"


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """How one checkpoint layout stores a layer's router and experts: full tensor names after the layer's
    prefix. The router's `[experts, hidden]` weight is `router`.

    Names holding `{e}` are one 2-D tensor per expert (`gate_up` then names the gate's and the up's);
    otherwise one 3-D tensor holds every expert: `gate_up` one name for the gate rows then the up rows
    of each expert (`[experts, 2 * intermediate, hidden]`), or two names, gate's and up's, each
    `[experts, intermediate, hidden]`; `down` is `[experts, hidden, intermediate]`."""

    router: str
    gate_up: tuple[str, ...]
    down: str
    #: The stacked tensors are stored `[experts, in, out]` (gpt-oss), not `[experts, out, in]`.
    transposed: bool = False
    #: One gate/up tensor's rows alternate gate, up, gate, up (gpt-oss), rather than every gate row first.
    interleaved: bool = False
    #: Each stacked tensor is the published MXFP4 pair `<name>_blocks`, uint8 `[experts, out, in / 32, 16]`,
    #: and `<name>_scales`, uint8 `[experts, out, in / 32]` (gpt-oss's published checkpoints; not transposed).
    mxfp4: bool = False

    def __post_init__(self) -> None:
        per_expert = {EXPERT in name for name in (*self.gate_up, self.down)}
        if len(per_expert) != 1 or len(self.gate_up) not in (1, 2) or (per_expert == {True} and len(self.gate_up) != 2):
            raise ValueError(f"an expert layout names its tensors all per expert (gate and up apart) or all "
                             f"stacked; got {self.gate_up}, {self.down}")
        if (self.transposed or self.interleaved) and self.per_expert or self.interleaved and len(self.gate_up) != 1:
            raise ValueError("only stacked experts are stored transposed, and only one gate/up tensor interleaved")
        if self.mxfp4 and (self.per_expert or self.transposed):
            raise ValueError("MXFP4 blocks hold stacked experts as `[experts, out, in]` rows, never transposed")

    @property
    def per_expert(self) -> bool:
        return EXPERT in self.down

    def marker(self) -> str:
        """The name whose presence says a checkpoint holds this layout (the first expert's gate)."""
        return BLOCKS.format(self.gate_up[0]) if self.mxfp4 else self.gate_up[0].replace(EXPERT, "0")

    def tensors(self, experts: int, hidden: int, intermediate: int, bias: bool = False) -> dict[str, tuple[int, ...]]:
        """The experts' tensors (the router's are `RouterSpec.tensors`), with their biases where `bias`."""
        h, ff = hidden, intermediate
        out: dict[str, tuple[int, ...]] = {}
        if self.per_expert:
            for e in range(experts):
                for name in self.gate_up:
                    out[name.replace(EXPERT, str(e))] = (ff, h)
                    if bias:
                        out[expert_bias_name(name.replace(EXPERT, str(e)))] = (ff,)
                out[self.down.replace(EXPERT, str(e))] = (h, ff)
                if bias:
                    out[expert_bias_name(self.down.replace(EXPERT, str(e)))] = (h,)
            return out
        rows = 2 * ff if len(self.gate_up) == 1 else ff
        for name in self.gate_up:
            out.update(self._stacked(name, (experts, h, rows) if self.transposed else (experts, rows, h)))
            if bias:
                out[expert_bias_name(name)] = (experts, rows)
        out.update(self._stacked(self.down, (experts, ff, h) if self.transposed else (experts, h, ff)))
        if bias:
            out[expert_bias_name(self.down)] = (experts, h)
        return out


    def _stacked(self, name: str, shape: tuple[int, int, int]) -> dict[str, tuple[int, ...]]:
        """A stacked weight's tensors: itself, or its MXFP4 blocks and scales (`mxfp4_tensors`)."""
        return mxfp4_tensors(name, shape) if self.mxfp4 else {name: shape}


#: The published MXFP4 pair's names, from the weight's.
BLOCKS, SCALES = "{}_blocks", "{}_scales"


def mxfp4_tensors(name: str, shape: tuple[int, int, int]) -> dict[str, tuple[int, ...]]:
    """The published MXFP4 pair of a stacked `[experts, out, in]` weight `name`: 32 values a block."""
    experts, out, cols = shape
    return {BLOCKS.format(name): (experts, out, cols // 32, 16), SCALES.format(name): (experts, out, cols // 32)}


def expert_bias_name(weight: str) -> str:
    """An expert weight's bias: `.weight` becomes `.bias`; a name without the suffix gains `_bias`
    (transformers' `gate_up_proj_bias`)."""
    return weight.removesuffix(".weight") + ".bias" if weight.endswith(".weight") else weight + "_bias"


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A sparse feed-forward block: `sum_k w_k * expert_k(x)` over the router's choice, plus a shared
    expert (times `sigmoid(x @ shared_gate)` where there is one)."""

    hidden: int
    #: Each expert's gated MLP width.
    intermediate: int
    router: RouterSpec
    #: The layouts the family's checkpoints store the experts in, its own first (module docstring).
    layouts: tuple[ExpertLayout, ...]
    #: The experts' gate activation ("silu").
    activation: str = "silu"
    #: The expert every row goes through, and its `[1, hidden]` sigmoid gate's weight name.
    shared: GatedMlpSpec | None = None
    shared_gate: str | None = None
    #: An RMSNorm on the block's output (as `GatedMlpSpec.out_norm`).
    out_norm: str | None = None
    #: An RMSNorm on the experts' input, after the router has read the block's input as it came (Gemma 4).
    expert_norm: str | None = None
    #: The experts' projections carry biases (gpt-oss).
    bias: bool = False
    #: gpt-oss's clamped SwiGLU (the activation "swiglu_clamped"): `(clamp(up, -limit, limit) + 1) * g *
    #: sigmoid(alpha * g)`, g the gate clamped above at `limit`.
    clamp: SwiGluClamp | None = None

    def __post_init__(self) -> None:
        if (self.activation == "swiglu_clamped") != (self.clamp is not None):
            raise ValueError("the clamped SwiGLU and its clamp come together")
        if not self.layouts:
            raise ValueError("a mixture-of-experts spec names at least one layout")
        if self.intermediate <= 0:
            raise ModelLoadError(f"the experts' intermediate size must be positive, got {self.intermediate}")
        if self.shared_gate is not None and self.shared is None:
            raise ValueError("a shared expert's gate needs a shared expert")

    def tensors(self, layout: ExpertLayout | None = None) -> dict[str, tuple[int, ...]]:
        """Every tensor of the block in `layout` (the family's own when None)."""
        layout = layout or self.layouts[0]
        out = self.router.tensors(layout.router, self.hidden)
        out.update(layout.tensors(self.router.experts, self.hidden, self.intermediate, self.bias))
        if self.shared is not None:
            out.update(self.shared.tensors())
        if self.shared_gate is not None:
            out[self.shared_gate] = (1, self.hidden)
        for norm in (self.out_norm, self.expert_norm):
            if norm is not None:
                out[f"{norm}.weight"] = (self.hidden,)
        return out
