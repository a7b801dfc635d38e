"""A tiny HF checkpoint of any family, written as a GGUF the way llama.cpp's converter writes that architecture.

`write_family_gguf` reads a folder `tiny_checkpoint.write_tiny_checkpoint` made and mirrors
convert_hf_to_gguf for its family: the metadata under the architecture's prefix (what llama.cpp writes,
and not what it hardcodes: Gemma 3's layer pattern and local RoPE base, SmolLM3's NoPE interval), the
tensor names of gguf-py's own map, Q/K rows permuted for llama and smollm3, one added to every Gemma
norm, Phi-3's longrope factors as tensors. Matrices are quantized the way a Q4_K_M file mixes types
(Q8_0, Q5_0, Q4_1, F16, BF16, and Q4_K / Q6_K where a row holds whole 256-value blocks). It returns the HF weights
the conversion must give back (the dequantized values) and an HF folder holding exactly those, so a
test can compare the GGUF with transformers reading it, or with our own load of the same weights.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
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
         "ffn_down": (Q.Q6_K, Q.Q8_0)}


@dataclass(slots=True)
class FamilyGguf:
    path: Path
    weights: dict[str, np.ndarray]  # HF names: what the conversion must give back
    hf_folder: Path  # the source folder's config and tokenizer with exactly `weights`
    config: dict[str, Any]


def write_family_gguf(source: Path, out: Path, arch: str, vocab: Vocabulary, *, quantized: bool = True,
                      seed: int = 0) -> FamilyGguf:
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
    GGUF_METADATA[arch](writer, config)
    vocab.write(writer)

    family = BY_GGUF_ARCHITECTURE[arch]
    names = gguf.get_tensor_name_map(ARCHS[arch], layers)
    weights: dict[str, np.ndarray] = {}
    for hf_name in sorted(hf):
        module, suffix = hf_name.rsplit(".", 1)
        gguf_name = names.get_name(module)
        assert gguf_name is not None, hf_name
        value = hf[hf_name].astype(np.float32)
        kind = gguf_name.split(".")[-1]
        qtype = Q.F32
        if quantized and value.ndim == 2:
            k_quant, other = QUANT[kind]
            qtype = k_quant if value.shape[1] % 256 == 0 else other
        offset = family.norm_offset and hf_name.endswith("norm.weight")
        if offset:
            value = value + np.float32(family.norm_offset)  # what llama.cpp's converter adds to such norms
        data, truth = stored(value, qtype, rng)  # row-wise blocks: the Q/K permutation below commutes with them
        if offset:
            truth = truth - np.float32(family.norm_offset)
        if family.permuted_qk and kind in ("attn_q", "attn_k"):
            data = llama_cpp_permute(data, heads if kind == "attn_q" else kv_heads)
        weights[hf_name] = truth
        # Float arrays carry their type; quantized ones (BF16 included) are bytes of the type named.
        raw = None if data.dtype in (np.float32, np.float16) else qtype
        writer.add_tensor(f"{gguf_name}.{suffix}", data, raw_dtype=raw)
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
