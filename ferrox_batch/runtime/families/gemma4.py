"""Gemma 4 (text): Gemma 3's layer with per-kind head shapes, shared K/V, per-layer inputs and a layer scalar.

What differs from Gemma 3, each carried by a shared spec field or config field (nothing below names it):
* the global (full-attention) layers have heads of their own size and count (`global_head_dim`,
  `num_global_key_value_heads`, written per layer as `per_layer_config`; `ModelConfig.global_head_dim`),
  and rotate by proportional RoPE (the first quarter of each head's pairs, at frequencies spaced over the
  whole head; `ModelConfig.proportional_rope`); the local layers rotate every pair;
* with `attention_k_eq_v` the global layers' values are their keys' projection (`AttentionSpec.v_from_k`);
  the values are RMS-normed per head without a scale (`v_norm`), the scores are not scaled (1.0), and the
  norms multiply by their weight (no offset from one);
* the last `num_kv_shared_layers` layers write no K/V: each attends over the last earlier layer of its kind
  that does (`ModelConfig.kv_source`; the KV store holds the writers' alone), and with `use_double_wide_mlp`
  their MLP is twice as wide;
* every layer adds its own input after its MLP (`hidden_size_per_layer_input`; `PerLayerInputSpec`), then
  multiplies the residual stream by its `layer_scalar`; the logits are soft-capped (`final_logit_softcapping`).
* with `enable_moe_block` every layer runs a mixture of experts beside its MLP (`ParallelFfnSpec`), routed by
  a softmax over an unscaled RMS norm of the stream times a learned scale, its top k renormalised and each
  times its expert's own scale (`RouterSpec.input_norm`, `input_scale`, `expert_scale`).
The multimodal checkpoint (`Gemma4ForConditionalGeneration`) is served as its text model (`WRAPPED`), and
llama.cpp's `gemma4` GGUF files as `gemma4_gguf` reads them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.family import Family, ModelShape, Wrapped
from ferrox_batch.runtime.families.gemma4_gguf import GGUF
from ferrox_batch.runtime.families.layer_spec import (AttentionSpec, GatedMlpSpec, LayerSpec, ParallelFfnSpec,
                                                      PerLayerInputSpec)
from ferrox_batch.runtime.families.moe_config import MoeShape, positive_int
from ferrox_batch.runtime.families.moe_spec import ExpertLayout, MoeSpec, RouterSpec
from ferrox_batch.runtime.families.rope_layout import RopeReading

ARCHITECTURE = "Gemma4ForCausalLM"
#: Where its checkpoints keep the router and the experts: one stacked tensor per projection.
LAYOUT = ExpertLayout(router="router.proj.weight", gate_up=("experts.gate_up_proj",), down="experts.down_proj")
#: The multimodal checkpoint: its text model's config is `text_config` and its tensors sit under
#: `model.language_model.`; served as that text model (the vision and audio towers are not read).
WRAPPED = Wrapped("Gemma4ForConditionalGeneration", ARCHITECTURE, "text_config", "model.language_model.")
KINDS = ("sliding_attention", "full_attention")


@dataclass(frozen=True, slots=True)
class Options:
    """Gemma 4's own settings: the global layers' values are their keys' projection (`attention_k_eq_v`), and
    the layers that share K/V have an MLP twice as wide (`use_double_wide_mlp`)."""

    k_eq_v: bool = False
    double_wide: bool = False


def layer(c: ModelShape, i: int) -> LayerSpec:
    """Layer `i` of a Gemma 4 text checkpoint."""
    shares = c.kv_of(i) != i
    options = c.options if isinstance(c.options, Options) else Options()
    k_eq_v = options.k_eq_v and c.window(i) is None
    d, kv_heads = c.layer_head_dim(i), c.layer_kv_heads(i)
    if shares:
        projections: tuple[str, ...] = ("self_attn.q_proj",)
    else:
        projections = llama.QKV[:2] if k_eq_v else llama.QKV
    # A sharing layer's K/V projections and norms, where a checkpoint still holds them, go unread.
    unread = (("self_attn.k_proj.weight", (kv_heads * d, c.hidden_size)),
              ("self_attn.v_proj.weight", (kv_heads * d, c.hidden_size)),
              ("self_attn.k_norm.weight", (d,))) if shares else ()
    mixer = AttentionSpec(
        hidden=c.hidden_size, heads=c.num_heads, kv_heads=kv_heads, head_dim=d, projections=projections,
        output="self_attn.o_proj", scale=1.0, rope=c.rope_kind(i), window=c.window(i),
        q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", out_norm="post_attention_layernorm",
        v_norm=True, v_from_k=k_eq_v and not shares, writes_kv=not shares, unread=unread)
    wide = 2 if shares and options.double_wide else 1
    after = None
    if c.per_layer_input_size:
        after = PerLayerInputSpec(c.hidden_size, c.per_layer_input_size, "per_layer_input_gate",
                                  "per_layer_projection", "post_per_layer_input_norm")
    dense = llama.gated_mlp(c, intermediate=wide * c.intermediate_size, out_norm="post_feedforward_layernorm")
    if c.moe is None:
        return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size, mixer=mixer, ffn=dense,
                         post_norm="pre_feedforward_layernorm", after=after, output_scale="layer_scalar")
    return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size, mixer=mixer, ffn=_dense_and_moe(c, dense),
                     post_norm=None, after=after, output_scale="layer_scalar")


def _dense_and_moe(c: ModelShape, dense: GatedMlpSpec) -> ParallelFfnSpec:
    """The dense MLP beside the mixture, both over the residual stream: the MLP behind its norm, the router
    over the stream as it is, the experts behind their own norm; each output normed, then their sum."""
    assert c.moe is not None
    router = RouterSpec(c.moe.experts, c.moe.top_k, renormalize=True, input_norm=True, input_scale="router.scale",
                        expert_scale="router.per_expert_scale")
    moe = MoeSpec(hidden=c.hidden_size, intermediate=c.moe.intermediate, router=router, layouts=(LAYOUT,),
                  activation=c.hidden_act, out_norm="post_feedforward_layernorm_2",
                  expert_norm="pre_feedforward_layernorm_2")
    return ParallelFfnSpec(c.hidden_size, (replace(dense, out_norm="post_feedforward_layernorm_1"), moe),
                           ("pre_feedforward_layernorm", None), out_norm="post_feedforward_layernorm")


def _global_heads(raw: Mapping[str, Any], types: list[str]) -> tuple[int | None, int | None]:
    """The global layers' head size and KV heads: `per_layer_config` as transformers writes it (one entry
    per global layer, all alike), else `global_head_dim` and `num_global_key_value_heads`."""
    per_layer = raw.get("per_layer_config")
    if per_layer is None:
        heads = raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v") else None
        return int(raw.get("global_head_dim") or 512), None if heads is None else int(heads)
    if not isinstance(per_layer, dict):
        raise ModelLoadError(f"per_layer_config must be an object, got {per_layer!r}")
    entries = {int(key): value for key, value in per_layer.items()}
    global_layers = {i for i, kind in enumerate(types) if kind == "full_attention"}
    if set(entries) - global_layers:
        raise ModelLoadError(f"per_layer_config overrides layers {sorted(set(entries) - global_layers)}, which are "
                             f"not full-attention layers: only the global layers' heads may differ")
    shapes = {(value.get("head_dim"), value.get("num_key_value_heads")) for value in entries.values()}
    if any(set(value) - {"head_dim", "num_key_value_heads"} for value in entries.values()) or len(shapes) > 1 \
            or (entries and set(entries) != global_layers):
        raise ModelLoadError("per_layer_config must give every full-attention layer the same head_dim and "
                             "num_key_value_heads, and nothing else")
    if not entries:
        return None, None
    dim, heads = shapes.pop()
    return (None if dim is None else int(dim)), (None if heads is None else int(heads))


def _kv_sources(types: list[str], shared: int) -> tuple[int, ...] | None:
    """Each layer's K/V source: the last `shared` layers read the last earlier writer of their kind."""
    if not shared:
        return None
    layers = len(types)
    first = layers - shared
    if first <= 0:
        raise ModelLoadError(f"num_kv_shared_layers {shared} leaves no layer writing K/V of {layers}")
    writers = {kind: max(i for i in range(first) if types[i] == kind) for kind in set(types[:first])}
    if set(types) - set(writers):
        raise ModelLoadError("a kind of layer that shares K/V has no earlier layer of its kind writing them")
    return tuple(i if i < first else writers[types[i]] for i in range(layers))


def config_fields(raw: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    # "vision" makes only image tokens attend both ways: text alone is causal, as served here.
    if raw.get("use_bidirectional_attention") not in (None, "vision"):
        raise ModelLoadError(f"use_bidirectional_attention {raw['use_bidirectional_attention']!r} is not "
                             f"supported: this runtime generates causally")
    if raw.get("attention_bias"):
        raise ModelLoadError("attention_bias is not supported on Gemma 4 (its checkpoints leave it off)")
    layers = shared["num_layers"]
    types = list(raw.get("layer_types") or
                 ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)])
    if len(types) != layers or set(types) - set(KINDS):
        raise ModelLoadError(f"layer_types must name {layers} layers of {KINDS}")
    types[-1] = "full_attention"  # as the reference forces it
    dim, heads = _global_heads(raw, types)
    size = int(raw.get("hidden_size_per_layer_input") or 0)
    per_layer_vocab = int(raw.get("vocab_size_per_layer_input") or 0) if size else 0
    if size and per_layer_vocab < shared["vocab_size"]:
        raise ModelLoadError(f"vocab_size_per_layer_input {per_layer_vocab} is below vocab_size "
                             f"{shared['vocab_size']}: some tokens would have no per-layer input")
    cap = raw.get("final_logit_softcapping")
    return {
        "window_layers": tuple(kind == "sliding_attention" for kind in types),
        "embed_scale": math.sqrt(shared["hidden_size"]),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "qk_norm": True,
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "global_head_dim": dim,
        "global_kv_heads": heads,
        "proportional_rope": True,
        "kv_source": _kv_sources(types, int(raw.get("num_kv_shared_layers") or 0)),
        "logit_softcap": None if cap is None else float(cap),
        "per_layer_input_size": size,
        "per_layer_vocab_size": per_layer_vocab,
        "options": Options(bool(raw.get("attention_k_eq_v")), bool(raw.get("use_double_wide_mlp"))),
        "max_position_embeddings": int(raw.get("max_position_embeddings", 131_072)),
        "moe": _moe(raw, layers),
    }


def _moe(raw: Mapping[str, Any], layers: int) -> MoeShape | None:
    """Every layer's mixture beside its MLP (`enable_moe_block`), its top k renormalised."""
    if not raw.get("enable_moe_block"):
        return None
    return MoeShape(positive_int(raw, "num_experts"), positive_int(raw, "top_k_experts"),
                    positive_int(raw, "moe_intermediate_size"), True, (True,) * layers)


FAMILY = Family(
    model_type="gemma4_text", architectures=(ARCHITECTURE,), layer=layer, config_fields=config_fields,
    rope=RopeReading(default_theta=1_000_000.0, local_theta=10_000.0, proportional=True), gguf=GGUF,
)
