"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 layer with a mixture of experts and a shared expert.

Each sparse layer routes a row to `num_experts_per_tok` of `num_experts` experts by softmax scores (divided
by their sum where `norm_topk_prob`), and adds a shared expert of `shared_expert_intermediate_size` scaled
by the sigmoid of its own gate (`mlp.shared_expert_gate`). Layers in `mlp_only_layers`, and those off the
`decoder_sparse_step`, are the dense MLP of `intermediate_size`.

llama.cpp's `qwen2moe` files (`gguf_moe`): every layer sparse, the shared expert as `ffn_*_shexp` and its gate
as `ffn_gate_inp_shexp` (HF's `[1, hidden]`, or 1-D), and the k weights never renormalised, as
`norm_topk_prob: false` (Qwen1.5-MoE, Qwen2-57B) has it; a source with `true` would differ in transformers,
and its file no longer says so, so it is read as llama.cpp computes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.runtime.families import llama, qwen2
from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.gguf_metadata import ConfigTensors, GgufFamily, Meta
from ferrox_batch.runtime.families.gguf_moe import ATTENTION_LAYER, SHARED_EXPERT_TENSORS, expert_fields, moe_layer
from ferrox_batch.runtime.families.layer_spec import LayerSpec
from ferrox_batch.runtime.families.moe_config import positive_int, read_moe, sparse_step_layers
from ferrox_batch.runtime.families.moe_layers import expert_layouts, feed_forward

LAYOUTS = expert_layouts()


def config_fields(raw: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    layers = positive_int(raw, "num_hidden_layers")
    # transformers 5 names the Q/K/V biases `qkv_bias` for this family (earlier configs: always on).
    return {**qwen2.config_fields(raw, shared), "attention_bias": bool(raw.get("qkv_bias", True)),
            "moe": read_moe(raw, experts_key=("num_experts", "num_local_experts"),
                            intermediate_key="moe_intermediate_size", shared_key="shared_expert_intermediate_size",
                            sparse_layers=sparse_step_layers(raw, layers))}


def layer(c: ModelShape, i: int) -> LayerSpec:
    """Layer `i` of a Qwen2-MoE checkpoint."""
    return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size, mixer=llama.attention(c, i),
                     ffn=feed_forward(c, i, LAYOUTS, shared=True, shared_gate=True))


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    """llama.cpp's qwen2moe: every layer sparse with the shared expert, the k weights never renormalised
    (`gguf_moe`), the Q/K/V biases where the file has them."""
    return {**qwen2.gguf_fields(meta, config, tensors), "qkv_bias": config["attention_bias"],
            "decoder_sparse_step": 1, "mlp_only_layers": [],
            **expert_fields(meta, config, experts_key="num_experts", renormalize=False,
                            width_key="moe_intermediate_size", shared_key="shared_expert_intermediate_size")}


ARCHITECTURE = "Qwen2MoeForCausalLM"
FAMILY = Family(model_type="qwen2_moe", architectures=(ARCHITECTURE,), layer=layer, config_fields=config_fields,
                gguf=GgufFamily("qwen2moe", ARCHITECTURE, "qwen2_moe",
                                moe_layer(ATTENTION_LAYER, SHARED_EXPERT_TENSORS), gguf_fields,
                                biased=frozenset({"attn_q", "attn_k", "attn_v"})))
