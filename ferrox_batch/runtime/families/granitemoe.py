"""IBM Granite 3.x MoE (granite-3.1-3b-a800m): the Granite layer, multipliers and all, with a mixture of
experts in every layer.

Its checkpoints store each layer's experts fused: `block_sparse_moe.input_linear` (`[experts, 2 *
intermediate, hidden]`, gate rows then up rows) and `output_linear`, the router at
`block_sparse_moe.router.layer`; transformers holds them as `block_sparse_moe.experts.gate_up_proj` and
`down_proj`, the router at `block_sparse_moe.router`. Its router takes the top k logits and a softmax over
those, which is the softmax scores divided by their sum.

llama.cpp's `granitemoe` files (`gguf_moe`): Granite's multipliers, Q/K rows permuted, the fused gate/up split
into `ffn_gate_exps` and `ffn_up_exps`; renormalised as transformers does. A shared expert (GraniteMoeShared,
`expert_shared_feed_forward_length`) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.runtime.families import granite, llama
from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.gguf_metadata import ConfigTensors, GgufFamily, Meta
from ferrox_batch.runtime.families.gguf_moe import ATTENTION_LAYER, expert_fields, moe_layer
from ferrox_batch.runtime.families.layer_spec import LayerSpec
from ferrox_batch.runtime.families.moe_config import read_moe
from ferrox_batch.runtime.families.moe_layers import STACKED, feed_forward
from ferrox_batch.runtime.families.moe_spec import ExpertLayout

LAYOUTS = (
    ExpertLayout(router="block_sparse_moe.router.layer.weight", gate_up=("block_sparse_moe.input_linear.weight",),
                 down="block_sparse_moe.output_linear.weight"),
    ExpertLayout(router="block_sparse_moe.router.weight", gate_up=("block_sparse_moe.experts.gate_up_proj",),
                 down="block_sparse_moe.experts.down_proj"),
    STACKED,
)


def config_fields(raw: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    return {**granite.config_fields(raw, shared),
            "moe": read_moe(raw, experts_key=("num_local_experts",), intermediate_key="intermediate_size",
                            renormalize=True)}


def layer(c: ModelShape, i: int) -> LayerSpec:
    """Layer `i` of a Granite MoE checkpoint."""
    own = c.options
    if not isinstance(own, granite.GraniteOptions):
        raise ModelLoadError("a Granite layer needs its multipliers (a config read by the granite family)")
    return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size,
                     mixer=llama.attention(c, i, scale=own.attention_multiplier), ffn=feed_forward(c, i, LAYOUTS),
                     residual_scale=own.residual_multiplier)


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    """llama.cpp's granitemoe: Granite's multipliers, the experts as wide as `feed_forward_length`, the k
    weights renormalised (`gguf_moe`). A shared expert is GraniteMoeShared's, a family not supported here."""
    shared = meta.integer("expert_shared_feed_forward_length", 0)
    if shared:
        raise ModelLoadError(f"metadata key granitemoe.expert_shared_feed_forward_length is {shared}: a shared "
                             f"expert (GraniteMoeShared) is not supported")
    return {**granite.gguf_fields(meta, config, tensors),
            **expert_fields(meta, config, experts_key="num_local_experts", renormalize=True)}


ARCHITECTURE = "GraniteMoeForCausalLM"
FAMILY = Family(model_type="granitemoe", architectures=(ARCHITECTURE,), layer=layer, config_fields=config_fields,
                gguf=GgufFamily("granitemoe", ARCHITECTURE, "granitemoe", moe_layer(ATTENTION_LAYER), gguf_fields,
                                permuted_qk=True))
