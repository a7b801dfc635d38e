"""Mixtral: the Mistral layer with a mixture of experts in every layer.

Every layer routes a row to `num_experts_per_tok` of `num_local_experts` experts of `intermediate_size`,
its softmax scores always divided by their sum. Its checkpoints name the block `block_sparse_moe` and each
expert's projections `w1` (gate), `w3` (up) and `w2` (down); transformers holds them as the other MoE
families (`mlp.experts`).

llama.cpp writes it as a `llama` file with `llama.expert_count` set (`gguf_moe`), Q/K rows permuted as
Llama's. Its converter drops `sliding_window` (llama.cpp's llama graph has none), so a Mixtral whose config
sets one (Mixtral-8x7B's is null) is read without it: the file no longer says it, and llama.cpp attends over
the whole context too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.gguf_metadata import ConfigTensors, GgufFamily, Meta
from ferrox_batch.runtime.families.gguf_moe import ATTENTION_LAYER, expert_fields, moe_layer
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


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    """llama.cpp's llama with experts: Llama's fields, the experts as wide as `feed_forward_length`, the k
    weights renormalised (`gguf_moe`), no window."""
    return {**llama.gguf_fields(meta, config, tensors), "sliding_window": None,
            **expert_fields(meta, config, experts_key="num_local_experts", renormalize=True)}


ARCHITECTURE = "MixtralForCausalLM"
FAMILY = Family(model_type="mixtral", architectures=(ARCHITECTURE,), layer=layer, config_fields=config_fields,
                gguf=GgufFamily("llama", ARCHITECTURE, "mixtral", moe_layer(ATTENTION_LAYER), gguf_fields,
                                permuted_qk=True, config_tensors=frozenset({"rope_freqs"}), experts_variant=True))
