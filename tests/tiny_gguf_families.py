"""A tiny HF checkpoint of any family, written as a GGUF the way llama.cpp's converter writes that architecture.

`write_family_gguf` reads a folder `tiny_checkpoint.write_tiny_checkpoint` made and mirrors
convert_hf_to_gguf for its family: the metadata under the architecture's prefix (what llama.cpp writes,
and not what it hardcodes: Gemma 3's layer pattern and local RoPE base, SmolLM3's NoPE interval), the
tensor names of gguf-py's own map, Q/K rows permuted for llama and smollm3, one added to every Gemma
norm, Phi-3's longrope factors as tensors, and a llama3-scaled source's per-frequency factors as the
`rope_freqs` tensor (computed as LlamaModel.generate_extra_tensors computes them). With `split_qkv`, Phi-3's
fused Q/K/V projection is written as separate `attn_q`, `attn_k` and `attn_v` tensors, which llama.cpp's phi3
architecture reads as well (its own converter writes the fused one). A mixture of experts is written as its
converter writes it (`converter_experts`): each layer's experts stacked into one 3-D tensor per projection
(Granite MoE's fused gate/up split in two), the router as `ffn_gate_inp`, `expert_count` and
`expert_used_count` from the config, and what each architecture adds (`tiny_families.GGUF_METADATA`); the
weights it returns are then under the reader's STACKED names. Matrices are quantized the way a
Q4_K_M file mixes types (Q8_0, Q5_0, Q4_1, F16, BF16, and Q4_K / Q6_K where a row holds whole 256-value
blocks; stacked experts in Q8_0, or F16 where a row is not whole 32-value blocks; with `mxfp4_experts`,
the stacked experts in MXFP4 and every other tensor in f32). gpt-oss is written as GptOssModel writes a
bf16 source: its interleaved, transposed gate/up split into gate and up, its biases with them, its
router as `ffn_gate_inp` with a bias, and its sinks as `attn_sinks.weight`. It returns the HF
weights the conversion must give back (the dequantized values) and an HF folder holding exactly those, so a test can compare the GGUF with transformers reading it, or with our own load of
the same weights.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file, save_file
from tiny_families import GGUF_METADATA
from tiny_gguf import Vocabulary, llama_cpp_permute, stored

from ferrox_batch.runtime.families.registry import BY_GGUF_ARCHITECTURE

#: gguf-py's architecture enum by llama.cpp's name for it.
ARCHS = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
#: What a Q4_K_M file stores each kind of matrix in; a K-quant falls back to the second type where a row
#: is not whole 256-value blocks.
QUANT = {"token_embd": (Q.Q8_0, Q.Q8_0), "output": (Q.Q6_K, Q.BF16), "attn_q": (Q.Q5_0, Q.Q5_0),
         "attn_k": (Q.Q5_0, Q.Q5_0), "attn_v": (Q.Q8_0, Q.F16), "attn_qkv": (Q.Q5_0, Q.Q5_0),
         "attn_output": (Q.Q4_K, Q.Q4_1), "ffn_gate": (Q.Q5_0, Q.Q5_0), "ffn_up": (Q.Q4_1, Q.Q4_1),
         "ffn_down": (Q.Q6_K, Q.Q8_0), "ffn_gate_shexp": (Q.Q5_0, Q.Q5_0), "ffn_up_shexp": (Q.Q4_1, Q.Q4_1),
         "ffn_down_shexp": (Q.Q6_K, Q.F16)}
#: Tensors llama.cpp's converter always writes in F32 (the routers).
F32_ALWAYS = ("ffn_gate_inp", "ffn_gate_inp_shexp")


@dataclass(slots=True)
class FamilyGguf:
    path: Path
    weights: dict[str, np.ndarray]  # HF names: what the conversion must give back
    hf_folder: Path  # the source folder's config and tokenizer with exactly `weights`
    config: dict[str, Any]


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter writes as `rope_freqs` for a llama3-scaled config: its own arithmetic (float32
    frequencies, float32 tensor arithmetic on each, the list stored as float32), step by step."""
    rope = config["rope_scaling"]
    base = config.get("rope_theta", 10000.0)
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    rope_factors: list[Any] = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def write_family_gguf(source: Path, out: Path, arch: str, vocab: Vocabulary, *, quantized: bool = True,
                      seed: int = 0, split_qkv: bool = False, mxfp4_experts: bool = False) -> FamilyGguf:
    """The checkpoint in `source` as `out/<arch>.gguf`, and its dequantized twin as `out/hf`."""
    rng = np.random.default_rng(seed)
    config = json.loads((source / "config.json").read_text())
    hf = load_file(str(source / "model.safetensors"))
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    hidden = config["hidden_size"]
    assert len(vocab.tokens) == hf["model.embed_tokens.weight"].shape[0], "the vocabulary must fill the embedding"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif scaling.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    # TextModel.set_gguf_parameters: the expert counts under their first key the config has
    experts = config.get("num_local_experts", config.get("num_experts"))
    if experts is not None:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    GGUF_METADATA[arch](writer, config)
    vocab.write(writer)
    hf = converter_experts(hf, config)

    family = BY_GGUF_ARCHITECTURE[arch]
    names = gguf.get_tensor_name_map(ARCHS[arch], layers)
    weights: dict[str, np.ndarray] = {}
    for hf_name in sorted(hf):
        # GptOssModel.filter_tensors gives the sinks a `.weight`
        module, suffix = (hf_name, "weight") if hf_name.endswith(".sinks") else hf_name.rsplit(".", 1)
        gguf_name = names.get_name(module)
        assert gguf_name is not None, hf_name
        value = hf[hf_name].astype(np.float32)
        if split_qkv and gguf_name.endswith(".attn_qkv"):
            head_dim = config["head_dim"]
            widths = np.cumsum([heads * head_dim, kv_heads * head_dim])
            parts = [(gguf_name[:-3] + short, part) for short, part in zip("qkv", np.split(value, widths))]
        else:
            parts = [(gguf_name, value)]
        truths = []
        for name, part in parts:
            truths.append(_write(writer, f"{name}.{suffix}", part, family, (heads, kv_heads), quantized, rng,
                                 mxfp4_experts))
        weights[hf_name] = np.concatenate(truths) if len(truths) > 1 else truths[0]
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    twin = out / "hf"
    twin.mkdir(exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, twin / name)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(twin / "model.safetensors"))
    return FamilyGguf(path, weights, twin, config)


def converter_experts(hf: dict[str, np.ndarray], config: dict[str, Any]) -> dict[str, np.ndarray]:
    """The source's tensors with each mixture-of-experts layer as the converters stack it: the per-expert
    projections (Qwen's and OLMoE's `mlp.experts.{e}.*_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`)
    stacked along a new first axis, Granite MoE's `input_linear` split into its gate and up rows, under the
    STACKED layout's names (`mlp.experts.gate_proj.weight`, ..., the router `mlp.gate.weight`), which gguf-py's
    map turns into `ffn_{gate,up,down}_exps` and `ffn_gate_inp` for every one of these architectures."""
    out, stacks = {}, {}
    if config["model_type"] == "gpt_oss":
        return _gpt_oss_experts(hf)
    mixtral = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for name, value in hf.items():
        pieces = name.split(".")
        if ".experts." in name and pieces[-3].isdigit():  # model.layers.{i}.<block>.experts.{e}.<proj>.weight
            proj = mixtral.get(pieces[-2], pieces[-2])
            stacks.setdefault(f"{'.'.join(pieces[:3])}.mlp.experts.{proj}.weight", {})[int(pieces[-3])] = value
        elif name.endswith(("block_sparse_moe.gate.weight", "block_sparse_moe.router.layer.weight")):
            out[f"{'.'.join(pieces[:3])}.mlp.gate.weight"] = value
        elif name.endswith("block_sparse_moe.input_linear.weight"):
            gate, up = np.split(value, 2, axis=-2)
            out[f"{'.'.join(pieces[:3])}.mlp.experts.gate_proj.weight"] = np.ascontiguousarray(gate)
            out[f"{'.'.join(pieces[:3])}.mlp.experts.up_proj.weight"] = np.ascontiguousarray(up)
        elif name.endswith("block_sparse_moe.output_linear.weight"):
            out[f"{'.'.join(pieces[:3])}.mlp.experts.down_proj.weight"] = value
        else:
            out[name] = value
    for name, by_expert in stacks.items():
        assert sorted(by_expert) == list(range(len(by_expert))), name
        out[name] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def _gpt_oss_experts(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GptOssModel.modify_tensors on a bf16 source: `[experts, in, out]` gate/up transposed and split into its
    alternating gate and up rows (its bias's columns likewise), down transposed, under the STACKED names."""
    out = {}
    for name, value in hf.items():
        layer = ".".join(name.split(".")[:3])
        if name.endswith("mlp.experts.gate_up_proj"):
            rows = value.swapaxes(-1, -2)
            out[f"{layer}.mlp.experts.gate_proj.weight"] = np.ascontiguousarray(rows[:, 0::2])
            out[f"{layer}.mlp.experts.up_proj.weight"] = np.ascontiguousarray(rows[:, 1::2])
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            out[f"{layer}.mlp.experts.gate_proj.bias"] = np.ascontiguousarray(value[..., 0::2])
            out[f"{layer}.mlp.experts.up_proj.bias"] = np.ascontiguousarray(value[..., 1::2])
        elif name.endswith("mlp.experts.down_proj"):
            out[f"{layer}.mlp.experts.down_proj.weight"] = np.ascontiguousarray(value.swapaxes(-1, -2))
        elif name.endswith("mlp.experts.down_proj_bias"):
            out[f"{layer}.mlp.experts.down_proj.bias"] = value
        elif ".mlp.router." in name:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = value
        else:
            out[name] = value
    return out


def _write(writer: gguf.GGUFWriter, name: str, value: np.ndarray, family: Any, heads: tuple[int, int],
           quantized: bool, rng: np.random.Generator, mxfp4_experts: bool = False) -> np.ndarray:
    """One tensor written as llama.cpp stores it; what it dequantizes to, as the HF checkpoint holds it."""
    kind = name.split(".")[-2]
    qtype = Q.F32
    if mxfp4_experts and value.ndim == 3 and name.endswith(".weight"):
        qtype = Q.MXFP4
    elif quantized and value.ndim == 3:
        qtype = Q.Q8_0 if value.shape[-1] % 32 == 0 else Q.F16
    elif quantized and value.ndim == 2 and kind not in F32_ALWAYS:
        k_quant, other = QUANT[kind]
        qtype = k_quant if value.shape[1] % 256 == 0 else other
    offset = family.norm_offset and name.endswith("norm.weight")
    if offset:
        value = value + np.float32(family.norm_offset)  # what llama.cpp's converter adds to such norms
    data, truth = stored(value, qtype, rng)  # row-wise blocks: the Q/K permutation below commutes with them
    if offset:
        truth = truth - np.float32(family.norm_offset)
    if family.permuted_qk and kind in ("attn_q", "attn_k"):
        data = llama_cpp_permute(data, heads[0] if kind == "attn_q" else heads[1])
    # Float arrays carry their type; quantized ones (BF16 included) are bytes of the type named.
    raw = None if data.dtype in (np.float32, np.float16) else qtype
    writer.add_tensor(name, data, raw_dtype=raw)
    return truth
