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

Checkpoints come in three layouts (`LAYOUTS`): transformers' own in bf16 or float32, as above; the
published one (`quantization_config: {quant_method: mxfp4}`), where each stacked expert weight is an MXFP4
pair, `*_blocks` and `*_scales`, `[experts, out, in]` rows (gate_up's rows interleaved, as stored) beside
the same biases, and everything else in bf16: the experts are served as stored (`quant.mxfp4`), where the
MXFP4 kernels run, and widened elsewhere; any other `quant_method` is refused by name. And llama.cpp's
`gpt-oss` GGUF (`GGUF`), read as the STACKED layout with biases (`mlp.experts.gate_proj.bias`, the router
`mlp.gate.weight` and `.bias`), its experts kept in the type the file holds them in (MXFP4 as converted).

llama.cpp reads of a `gpt-oss` file the expert counts and `expert_feed_forward_length` (the experts'
width), `attention.sliding_window` and which layers slide (`attention.sliding_window_pattern`: a flag a
layer, or a period; every even layer where absent), YaRN's factor, original context and betas, the sinks
as `attn_sinks` and the biases; it hardcodes the SwiGLU's alpha 1.702 and limit 7 and YaRN's truncated
correction range (transformers' `truncate: true`), which a source setting other values (the published
gpt-oss's `truncate: false`) no longer says: the reader gives what llama.cpp computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.gguf_metadata import LLAMA_LAYER, ConfigTensors, GgufFamily, Meta, full_rotary
from ferrox_batch.runtime.families.gguf_moe import EXPERT_TENSORS, expert_fields
from ferrox_batch.runtime.families.layer_spec import LayerSpec
from ferrox_batch.runtime.families.moe_config import read_moe
from ferrox_batch.runtime.families.moe_layers import STACKED, moe_shape
from ferrox_batch.runtime.families.moe_spec import ExpertLayout, MoeSpec, RouterSpec, SwiGluClamp

#: transformers' layout (the experts transposed and interleaved), the published MXFP4 one, the GGUF reader's
#: (its biases `mlp.experts.gate_proj.bias` and so on, `moe_spec.expert_bias_name`).
LAYOUTS = (
    ExpertLayout(router="mlp.router.weight", gate_up=("mlp.experts.gate_up_proj",), down="mlp.experts.down_proj",
                 transposed=True, interleaved=True),
    ExpertLayout(router="mlp.router.weight", gate_up=("mlp.experts.gate_up_proj",), down="mlp.experts.down_proj",
                 interleaved=True, mxfp4=True),
    STACKED,
)
#: The one `quantization_config.quant_method` read: the published MXFP4 experts.
QUANT_METHOD = "mxfp4"


def config_fields(raw: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    quantization = raw.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        if method != QUANT_METHOD:
            raise ModelLoadError(f"config field quantization_config: quant_method {method!r} is not read (only "
                                 f"{QUANT_METHOD!r}, the published experts' MXFP4 blocks)")
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


#: llama.cpp's `gpt-oss` layer tensors -> the HF names (the experts under the STACKED layout's).
GGUF_LAYER = MappingProxyType({**{name: hf for name, hf in LLAMA_LAYER.items() if name not in ("ffn_gate", "ffn_up", "ffn_down",
                                                                             "ffn_norm")},
              "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks", **EXPERT_TENSORS})
#: What llama.cpp hardcodes: the SwiGLU's constants, every other layer sliding (the first).
GGUF_SWIGLU, GGUF_PATTERN = SwiGluClamp(alpha=1.702, limit=7.0), 2


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    """llama.cpp's gpt-oss (module docstring): the experts' width, the windows, the hardcoded SwiGLU."""
    full_rotary(meta, config)
    layers = config["num_hidden_layers"]
    pattern = meta.key("attention.sliding_window_pattern", GGUF_PATTERN)
    if isinstance(pattern, list):  # one flag per layer: true where it slides
        if len(pattern) != layers:
            raise ModelLoadError(f"{meta.arch}.attention.sliding_window_pattern names {len(pattern)} layers of "
                                 f"{layers}")
        local = [bool(flag) for flag in pattern]
    else:
        period = meta.integer("attention.sliding_window_pattern", GGUF_PATTERN)
        local = [period == 0 or i % period < period - 1 for i in range(layers)]  # 0: every layer, as llama.cpp
    if meta.number("rope.freq_base_swa", config["rope_theta"]) != config["rope_theta"]:
        raise ModelLoadError(f"{meta.arch}.rope.freq_base_swa differs from rope.freq_base: a RoPE base of the "
                             f"sliding layers' own is not read for gpt-oss")
    width = meta.integer("expert_feed_forward_length")
    if width <= 0:
        raise ModelLoadError(f"metadata key {meta.arch}.expert_feed_forward_length is {width}: a width must be "
                             f"positive")
    return {**expert_fields(meta, config, experts_key="num_local_experts", renormalize=True),
            "intermediate_size": width, "sliding_window": meta.integer("attention.sliding_window"),
            "layer_types": ["sliding_attention" if slides else "full_attention" for slides in local],
            "swiglu_alpha": GGUF_SWIGLU.alpha, "swiglu_limit": GGUF_SWIGLU.limit}


ARCHITECTURE = "GptOssForCausalLM"
GGUF = GgufFamily("gpt-oss", ARCHITECTURE, "gpt_oss", GGUF_LAYER, gguf_fields, biased=frozenset(
    {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}),
                  bare=frozenset({"attn_sinks"}))
FAMILY = Family(model_type="gpt_oss", architectures=(ARCHITECTURE,), layer=layer, config_fields=config_fields,
                gguf=GGUF)
