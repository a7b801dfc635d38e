"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 layer with a mixture of experts.

Each sparse layer routes a row to `num_experts_per_tok` of `num_experts` experts (transformers 5 writes
`num_local_experts`) by softmax scores, divided by their sum where `norm_topk_prob`; no shared expert.
Layers in `mlp_only_layers`, and those off the `decoder_sparse_step`, are the dense MLP.

llama.cpp's `qwen3moe` files (`gguf_moe`): every layer sparse, and the k weights always renormalised, as
`norm_topk_prob: true` (every published Qwen3-MoE) has it; a source with `false` would differ in transformers,
and its file no longer says so, so it is read as llama.cpp computes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.runtime.families import llama, qwen2
from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.gguf_metadata import QK_NORMS, ConfigTensors, GgufFamily, Meta
from ferrox_batch.runtime.families.gguf_moe import ATTENTION_LAYER, expert_fields, moe_layer
from ferrox_batch.runtime.families.layer_spec import LayerSpec
from ferrox_batch.runtime.families.moe_config import positive_int, read_moe, sparse_step_layers
from ferrox_batch.runtime.families.moe_layers import expert_layouts, feed_forward

LAYOUTS = expert_layouts()


def config_fields(raw: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    layers = positive_int(raw, "num_hidden_layers")
    return {"qk_norm": True, **llama.no_window_unless_used(raw, shared),
            "moe": read_moe(raw, experts_key=("num_experts", "num_local_experts"),
                            intermediate_key="moe_intermediate_size", sparse_layers=sparse_step_layers(raw, layers))}


def layer(c: ModelShape, i: int) -> LayerSpec:
    """Layer `i` of a Qwen3-MoE checkpoint."""
    mixer = llama.attention(c, i, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
    return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size, mixer=mixer,
                     ffn=feed_forward(c, i, LAYOUTS))


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    """llama.cpp's qwen3moe: every layer sparse, the k weights always renormalised (`gguf_moe`)."""
    return {**qwen2.gguf_fields(meta, config, tensors), "decoder_sparse_step": 1, "mlp_only_layers": [],
            **expert_fields(meta, config, experts_key="num_experts", renormalize=True,
                            width_key="moe_intermediate_size")}


ARCHITECTURE = "Qwen3MoeForCausalLM"
FAMILY = Family(model_type="qwen3_moe", architectures=(ARCHITECTURE,), layer=layer, config_fields=config_fields,
                gguf=GgufFamily("qwen3moe", ARCHITECTURE, "qwen3_moe", moe_layer(ATTENTION_LAYER, QK_NORMS),
                                gguf_fields))
