"""Mixtral: the Mistral layer with a mixture of experts in every layer.

Every layer routes a row to `num_experts_per_tok` of `num_local_experts` experts of `intermediate_size`,
its softmax scores always divided by their sum. Its checkpoints name the block `block_sparse_moe` and each
expert's projections `w1` (gate), `w3` (up) and `w2` (down); transformers holds them as the other MoE
families (`mlp.experts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.layer_spec import LayerSpec
from ferrox_batch.runtime.families.moe_config import read_moe
from ferrox_batch.runtime.families.moe_layers import expert_layouts, feed_forward, per_expert

LAYOUTS = expert_layouts(per_expert("block_sparse_moe", "gate", ("w1", "w3", "w2")))


def config_fields(raw: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    return {"moe": read_moe(raw, experts_key=("num_local_experts",), intermediate_key="intermediate_size",
                            renormalize=True)}


def layer(c: ModelShape, i: int) -> LayerSpec:
    """Layer `i` of a Mixtral checkpoint."""
    return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size, mixer=llama.attention(c, i),
                     ffn=feed_forward(c, i, LAYOUTS))


ARCHITECTURE = "MixtralForCausalLM"
FAMILY = Family(model_type="mixtral", architectures=(ARCHITECTURE,), layer=layer, config_fields=config_fields)
