"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with sinks and biases over alternating windows, and a
mixture of experts with biases and a clamped SwiGLU in every layer.

* Attention: Q/K/V and output projections with biases; a learned sink per query head in each softmax's
  denominator (`self_attn.sinks`); every other layer attends over a sliding window (`layer_types`,
  `sliding_window`); YaRN RoPE (its `truncate: false` read as written).
* Feed-forward: the router (with a bias) takes each row's top k logits and a softmax over those: the
  softmax scores divided by their sum. Each expert's gate/up projection is stored `[experts, hidden, 2 *
  intermediate]`, gate and up columns alternating, and its down projection `[experts, intermediate,
  hidden]`, each with a bias; the activation is `(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)` with
  `g = min(gate, l)` (`swiglu_alpha`, `swiglu_limit`).

Checkpoints saved by transformers hold the experts in bf16 or float32 this way; the published ones' MXFP4
blocks are not read yet (refused by name).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.layer_spec import LayerSpec
from ferrox_batch.runtime.families.moe_config import read_moe
from ferrox_batch.runtime.families.moe_layers import STACKED, moe_shape
from ferrox_batch.runtime.families.moe_spec import ExpertLayout, MoeSpec, RouterSpec, SwiGluClamp

#: transformers' layout (the experts transposed and interleaved), then the GGUF reader's.
LAYOUTS = (
    ExpertLayout(router="mlp.router.weight", gate_up=("mlp.experts.gate_up_proj",), down="mlp.experts.down_proj",
                 transposed=True, interleaved=True),
    STACKED,
)


def config_fields(raw: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    if raw.get("quantization_config") is not None:
        method = raw["quantization_config"].get("quant_method") if isinstance(raw["quantization_config"], dict) \
            else raw["quantization_config"]
        raise ModelLoadError(f"config field quantization_config ({method!r}): the published MXFP4 experts are not "
                             f"read from safetensors yet; serve the checkpoint's GGUF, or one saved in bf16")
    layers = shared["num_layers"]
    types = raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ModelLoadError(f"config field layer_types names kinds this runtime does not run: {sorted(unknown)}")
    try:
        clamp = SwiGluClamp(alpha=float(raw.get("swiglu_alpha", 1.702)), limit=float(raw.get("swiglu_limit", 7.0)))
    except (TypeError, ValueError):
        raise ModelLoadError("config fields swiglu_alpha and swiglu_limit must be numbers") from None
    return {
        "window_layers": tuple(kind == "sliding_attention" for kind in types),
        "attention_bias": bool(raw.get("attention_bias", True)),
        "options": clamp,
        "moe": read_moe(raw, experts_key=("num_local_experts",), intermediate_key="intermediate_size",
                        renormalize=True),
    }


def layer(c: ModelShape, i: int) -> LayerSpec:
    """Layer `i` of a gpt-oss checkpoint."""
    clamp = c.options
    if not isinstance(clamp, SwiGluClamp):
        raise ModelLoadError("a gpt-oss layer needs its SwiGLU's clamp (a config read by the gpt_oss family)")
    moe = moe_shape(c)
    mixer = llama.attention(c, i, output_bias=c.attention_bias, sinks="self_attn.sinks")
    ffn = MoeSpec(hidden=c.hidden_size, intermediate=moe.intermediate,
                  router=RouterSpec(experts=moe.experts, top_k=moe.top_k, renormalize=True, bias=True),
                  layouts=LAYOUTS, activation="swiglu_clamped", clamp=clamp, bias=True)
    return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size, mixer=mixer, ffn=ffn)


ARCHITECTURE = "GptOssForCausalLM"
FAMILY = Family(model_type="gpt_oss", architectures=(ARCHITECTURE,), layer=layer, config_fields=config_fields)
