"""OLMoE (OLMoE-1B-7B): the Llama layer with norms over the whole query and key projections and a mixture
of experts in every layer.

The norms sit before each block, as Llama's; the queries and keys are normalised over the whole projection
(as OLMo 2's) before RoPE. Every layer routes a row to `num_experts_per_tok` of `num_experts` experts of
`intermediate_size` by softmax scores, divided by their sum where `norm_topk_prob`. `clip_qkv` (clamping the
projections) is refused: no published OLMoE sets it.

llama.cpp's `olmoe` files (`gguf_moe`): the k weights never renormalised (OLMoE's `norm_topk_prob: false`;
a source with `true` is read as llama.cpp computes it), and the converter writes an RMSNorm epsilon of 1e-5
whatever the config says (OLMoE-1B-7B's is 1e-5): the file is read as it says, as llama.cpp reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.gguf_metadata import QK_NORMS, ConfigTensors, GgufFamily, Meta, full_rotary
from ferrox_batch.runtime.families.gguf_moe import ATTENTION_LAYER, expert_fields, moe_layer
from ferrox_batch.runtime.families.layer_spec import LayerSpec
from ferrox_batch.runtime.families.moe_config import read_moe
from ferrox_batch.runtime.families.moe_layers import expert_layouts, feed_forward

LAYOUTS = expert_layouts()


def config_fields(raw: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    if raw.get("clip_qkv") is not None:
        raise ModelLoadError(f"config field clip_qkv ({raw['clip_qkv']!r}) is not supported: set it to null")
    return {"moe": read_moe(raw, experts_key=("num_experts", "num_local_experts"), intermediate_key="intermediate_size")}


def layer(c: ModelShape, i: int) -> LayerSpec:
    """Layer `i` of an OLMoE checkpoint."""
    mixer = llama.attention(c, i, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_norm_span="projection")
    return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size, mixer=mixer,
                     ffn=feed_forward(c, i, LAYOUTS))


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    """llama.cpp's olmoe: the experts as wide as `feed_forward_length`, the k weights never renormalised
    (`gguf_moe`)."""
    full_rotary(meta, config)
    return {"clip_qkv": None, **expert_fields(meta, config, experts_key="num_experts", renormalize=False)}


ARCHITECTURE = "OlmoeForCausalLM"
FAMILY = Family(model_type="olmoe", architectures=(ARCHITECTURE,), layer=layer, config_fields=config_fields,
                gguf=GgufFamily("olmoe", ARCHITECTURE, "olmoe", moe_layer(ATTENTION_LAYER, QK_NORMS), gguf_fields))
