"""The pieces the mixture-of-experts families build their sparse layers from.

`expert_layouts` lists the layouts a family's checkpoints store its experts in (`moe_spec.ExpertLayout`):
its own published one (one 2-D tensor per expert, under its names), the one transformers holds in memory
and some checkpoints are saved in (one `[experts, 2 * intermediate, hidden]` gate/up tensor and one down
tensor under `mlp.experts`, the router at `mlp.gate`), and the one the GGUF reader gives (one stacked
tensor per projection). `feed_forward` is layer `i`'s block: the mixture where the config marks the layer
sparse, else the dense gated MLP.
"""

from __future__ import annotations

from typing import Any

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.family import ModelShape
from ferrox_batch.runtime.families.layer_spec import GatedMlpSpec
from ferrox_batch.runtime.families.moe_config import MoeShape
from ferrox_batch.runtime.families.moe_spec import EXPERT, ExpertLayout, MoeSpec, RouterSpec

#: The layout transformers holds in memory (and saves where asked not to convert back).
FUSED = ExpertLayout(router="mlp.gate.weight", gate_up=("mlp.experts.gate_up_proj",), down="mlp.experts.down_proj")
#: The layout the GGUF reader gives: llama.cpp's `ffn_{gate,up,down}_exps`, one stacked tensor each.
STACKED = ExpertLayout(router="mlp.gate.weight",
                       gate_up=("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight"),
                       down="mlp.experts.down_proj.weight")


def per_expert(block: str = "mlp", router: str = "gate", names: tuple[str, str, str] = (
        "gate_proj", "up_proj", "down_proj")) -> ExpertLayout:
    """One 2-D tensor per expert and projection: `<block>.experts.{e}.<name>.weight`, the router at
    `<block>.<router>.weight`."""
    gate, up, down = (f"{block}.experts.{EXPERT}.{name}.weight" for name in names)
    return ExpertLayout(router=f"{block}.{router}.weight", gate_up=(gate, up), down=down)


def expert_layouts(own: ExpertLayout | None = None) -> tuple[ExpertLayout, ...]:
    """The family's own layout (Qwen's per-expert names where None), then transformers' and the GGUF reader's."""
    return (own or per_expert(), FUSED, STACKED)


def moe_shape(c: ModelShape) -> MoeShape:
    if c.moe is None:
        raise ModelLoadError("a mixture-of-experts layer needs its experts' shape (a config read by its family)")
    return c.moe


def feed_forward(c: ModelShape, i: int, layouts: tuple[ExpertLayout, ...], *, shared: bool = False,
                 shared_gate: bool = False, **router: Any) -> GatedMlpSpec | MoeSpec:
    """Layer `i`'s feed-forward block: the mixture over `layouts` where the config marks the layer sparse
    (`router`: `RouterSpec` fields beyond the shape's), with Qwen's shared expert where `shared`, and its
    sigmoid gate where `shared_gate`; else the dense gated MLP."""
    moe = moe_shape(c)
    if not moe.sparse(i):
        return llama.gated_mlp(c)
    shared_spec = None
    if shared and moe.shared_intermediate is not None:
        shared_spec = llama.gated_mlp(c, intermediate=moe.shared_intermediate,
                                      projections=("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
                                      down="mlp.shared_expert.down_proj")
    return MoeSpec(
        hidden=c.hidden_size, intermediate=moe.intermediate,
        router=RouterSpec(experts=moe.experts, top_k=moe.top_k, renormalize=moe.renormalize, **router),
        layouts=layouts, activation=c.hidden_act, shared=shared_spec,
        shared_gate="mlp.shared_expert_gate.weight" if shared_spec is not None and shared_gate else None,
    )
