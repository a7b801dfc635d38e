"""Each family's test entries: what a tiny checkpoint of it sets in its `config.json`, and what llama.cpp's
converter writes into a GGUF of it beyond the shared keys.

The fixtures (`tiny_checkpoint`, `tiny_gguf_families`) are otherwise generic: the tensors, their names and
shapes, the norms' offsets and the Q/K permutation come from the package's family registry. A new family
adds one entry to each table here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf


#: A config entry's value that removes the shared field instead of setting it.
DROP = object()


@dataclass(frozen=True, slots=True)
class FixtureArgs:
    """The fixture's arguments a family's config entry may read."""

    layers: int
    head_dim: int
    sliding_window: int | None
    rope_scaling: dict[str, Any] | None
    no_rope_layers: list[int] | None
    partial_rotary_factor: float | None
    layer_types: list[str] | None
    query_pre_attn_scalar: float | None
    pad_token_id: int | None


def _no_window(args: FixtureArgs) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None}


def _smollm3(args: FixtureArgs) -> dict[str, Any]:
    return {**_no_window(args), "attention_bias": False,
            "no_rope_layers": args.no_rope_layers if args.no_rope_layers is not None else [1] * args.layers,
            "pad_token_id": args.pad_token_id}  # its default names an id past this vocabulary


def _phi3(args: FixtureArgs) -> dict[str, Any]:
    out: dict[str, Any] = {"pad_token_id": args.pad_token_id, "sliding_window": args.sliding_window}
    if args.partial_rotary_factor is not None:
        out["partial_rotary_factor"] = args.partial_rotary_factor
    if args.rope_scaling is not None and args.rope_scaling.get("rope_type") == "longrope":
        out["original_max_position_embeddings"] = args.rope_scaling["original_max_position_embeddings"]
    return out


def _gemma3(args: FixtureArgs) -> dict[str, Any]:
    return {
        "hidden_act": DROP,
        "hidden_activation": "gelu_pytorch_tanh",
        "pad_token_id": args.pad_token_id,
        "sliding_window": args.sliding_window or 8,
        "layer_types": args.layer_types or ["sliding_attention"] * (args.layers - 1) + ["full_attention"],
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": args.query_pre_attn_scalar or args.head_dim,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _gemma4(args: FixtureArgs) -> dict[str, Any]:
    # RoPE per layer kind only (proportional on the global layers), and global heads twice the local ones.
    return {
        "hidden_act": DROP,
        "rope_theta": DROP,
        "hidden_activation": "gelu_pytorch_tanh",
        "pad_token_id": args.pad_token_id,
        "sliding_window": args.sliding_window or 8,
        "layer_types": args.layer_types or ["sliding_attention"] * (args.layers - 1) + ["full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 5_000.0},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 200_000.0}},
        "global_head_dim": 2 * args.head_dim,
        "rms_norm_eps": 1e-6,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "attention_k_eq_v": False,
        "final_logit_softcapping": None,
    }


#: model_type -> the config fields its tiny checkpoints set beyond the shared ones (`DROP`: remove one).
CONFIGS: dict[str, Callable[[FixtureArgs], dict[str, Any]]] = {
    "llama": lambda args: {},
    "mistral": lambda args: {"sliding_window": args.sliding_window},
    "qwen2": _no_window,
    "qwen3": lambda args: {**_no_window(args), "attention_bias": False},
    "smollm3": _smollm3,
    "phi3": _phi3,
    "gemma3_text": _gemma3,
    "gemma4_text": _gemma4,
    # Every multiplier away from 1 (the attention's from head_dim ** -0.5), and a base away from 10,000.
    "granite": lambda args: {"embedding_multiplier": 2.0, "attention_multiplier": 0.5, "residual_multiplier": 1.5,
                             "logits_scaling": 0.5, "rope_theta": 123456.0, "rms_norm_eps": 1e-6,
                             "attention_bias": False, "mlp_bias": False},
    "olmo2": lambda args: {"rope_theta": 123456.0, "rms_norm_eps": 1e-6, "attention_bias": False},
    # The mixture-of-experts families: eight experts of their own width, two or three per token, a base away
    # from 10,000; the tests' `extra_config` makes some layers dense.
    "qwen3_moe": lambda args: {**_no_window(args), "attention_bias": False, "num_experts": 8,
                               "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True,
                               "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 123456.0},
    "qwen2_moe": lambda args: {**_no_window(args), "qkv_bias": True, "num_experts": 8, "num_experts_per_tok": 3,
                               "moe_intermediate_size": 40, "shared_expert_intermediate_size": 72,
                               "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                               "rope_theta": 54321.0},
    "olmoe": lambda args: {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False, "clip_qkv": None,
                           "attention_bias": False, "rope_theta": 54321.0, "pad_token_id": args.pad_token_id},
    "granitemoe": lambda args: {"num_local_experts": 6, "num_experts_per_tok": 2, "embedding_multiplier": 2.0,
                                "attention_multiplier": 0.5, "residual_multiplier": 1.5, "logits_scaling": 0.5,
                                "rope_theta": 123456.0, "rms_norm_eps": 1e-6, "attention_bias": False},
    # Alternating windows, YaRN with `truncate: false` over a short pretrained context, a SwiGLU limit the tiny
    # activations reach (gpt-oss's own is 7).
    "gpt_oss": lambda args: {"num_local_experts": 8, "num_experts_per_tok": 2, "attention_bias": True,
                             "sliding_window": args.sliding_window or 5,
                             "layer_types": args.layer_types or [("sliding_attention", "full_attention")[i % 2]
                                                                 for i in range(args.layers)],
                             "rope_theta": 150000.0, "swiglu_alpha": 1.702, "swiglu_limit": 0.8,
                             "rope_scaling": args.rope_scaling or {
                                 "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "original_max_position_embeddings": 64, "truncate": False},
                             "pad_token_id": args.pad_token_id},
    "mixtral": lambda args: {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": args.sliding_window,
                             "rope_theta": 1_000_000.0},
}


def _rope_dims_and_vocab(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])


def _heads(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])


def _phi3_gguf(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    import numpy as np

    scaling = config.get("rope_scaling") or {}
    rope_dims = int(config.get("partial_rotary_factor", 1.0) * config["hidden_size"]) // config["num_attention_heads"]
    writer.add_rope_scaling_orig_ctx_len(config.get("original_max_position_embeddings")
                                         or config["max_position_embeddings"])
    writer.add_rope_dimension_count(rope_dims)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if scaling.get("rope_type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], dtype=np.float32))


def _gemma3_gguf(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    _heads(writer, config)
    writer.add_sliding_window(config["sliding_window"])


def _granite_gguf(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """Its converter drops `head_dim`, writes Llama's keys, then each multiplier that is not zero."""
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_attention_scale(config["attention_multiplier"])
    writer.add_embedding_scale(config["embedding_multiplier"])
    writer.add_residual_scale(config["residual_multiplier"])
    writer.add_logit_scale(config["logits_scaling"])


def _qwen_moe_gguf(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """Qwen2MoeModel (and Qwen3MoeModel, its subclass): the experts' width, and the shared expert's where set."""
    _heads(writer, config)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size") is not None:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _olmoe_gguf(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """OlmoeModel writes an epsilon of 1e-5 over the config's (the tiny one's is 1e-5 already)."""
    _heads(writer, config)
    writer.add_layer_norm_rms_eps(1e-5)


def _gpt_oss_gguf(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """GptOssModel: the window and the experts' width; TextModel's YaRN betas (the shared writer's YaRN has
    its factor and original context only)."""
    _heads(writer, config)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "yarn":
        if scaling.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        if scaling.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])


#: llama.cpp's architecture name -> what its converter writes beyond the keys every family gets.
GGUF_METADATA: dict[str, Callable[[gguf.GGUFWriter, dict[str, Any]], None]] = {
    "llama": _rope_dims_and_vocab,
    "qwen2": _heads,
    "qwen3": _heads,
    "smollm3": _rope_dims_and_vocab,
    "phi3": _phi3_gguf,
    "gemma3": _gemma3_gguf,
    "granite": _granite_gguf,
    "olmo2": _heads,
    "qwen3moe": _qwen_moe_gguf,
    "qwen2moe": _qwen_moe_gguf,
    "olmoe": _olmoe_gguf,
    "granitemoe": _granite_gguf,  # GraniteMoeModel adds only a shared expert's width, which this one lacks
    "gpt-oss": _gpt_oss_gguf,
}
