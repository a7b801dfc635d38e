"""A tiny llama written as a GGUF the way llama.cpp's converter writes one.

The tiny model has known HF weights; the file stores them as llama.cpp does
(Q/K rows permuted, some tensors quantized), so tests can check that the
conversion gives the original weights back. Used by test_gguf_convert.py and
test_fetch.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FF, LAYERS = 64, 4, 2, 16, 96, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
CORPUS = [
    "the quick brown fox jumps over the lazy dog", "The year 2024 had 366 days.",
    "def main():\n    return 42\n", "café naïve résumé", "hello world, hello there",
    "  indented  text\twith tabs\n\nand blank lines", "emoji 😀 and 日本語",
] * 20
TRICKY = ["Hello world", " leading space", "two  spaces", "trailing   ", "\n\nnew\nlines\n",
          "tabs\tand\r\nCRLF", "café naïve 日本語", "emoji 😀👍🏽", "x = 12345 + 0.5", "a\n  1\n",
          "<|im_start|>user\nHi<|im_end|>\n", "<|endoftext|>", "", " "]


@dataclass(slots=True)
class TinyModel:
    path: Path
    weights: dict[str, np.ndarray]  # HF names, what the conversion must give back
    reference: Tokenizer  # the tokenizer the GGUF's vocabulary came from


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _train_tokenizer(pre: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if pre == "smollm" else byte_level)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_tiny_gguf(path: Path, *, tied: bool = True, arch: str = "llama", add_bos: bool = False,
                    pre: str = "smollm", seed: int = 0) -> TinyModel:
    rng = np.random.default_rng(seed)
    reference = _train_tokenizer(pre)
    vocab = reference.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    raw_merges = json.loads(reference.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw_merges]

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * 0.2

    weights = {"model.embed_tokens.weight": w(len(tokens), HIDDEN),
               "model.norm.weight": 1 + w(HIDDEN)}
    if not tied:
        weights["lm_head.weight"] = w(len(tokens), HIDDEN)
    names = {"attn_q": ("self_attn.q_proj", (HEADS * HEAD_DIM, HIDDEN)),
             "attn_k": ("self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
             "attn_v": ("self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
             "attn_output": ("self_attn.o_proj", (HIDDEN, HEADS * HEAD_DIM)),
             "ffn_gate": ("mlp.gate_proj", (FF, HIDDEN)), "ffn_up": ("mlp.up_proj", (FF, HIDDEN)),
             "ffn_down": ("mlp.down_proj", (HIDDEN, FF)),
             "attn_norm": ("input_layernorm", (HIDDEN,)), "ffn_norm": ("post_attention_layernorm", (HIDDEN,))}

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)

    def put(name: str, value: np.ndarray, qtype: Q = Q.F32) -> None:
        if qtype == Q.F32:
            writer.add_tensor(name, value)
        else:
            writer.add_tensor(name, quantize(value, qtype), raw_dtype=qtype)

    # Quantized tensors come back as dequantize(quantize(x)); record that as the truth.
    def roundtrip(value: np.ndarray, qtype: Q) -> np.ndarray:
        return value if qtype == Q.F32 else dequantize(quantize(value, qtype), qtype).reshape(value.shape)

    weights["model.embed_tokens.weight"] = roundtrip(weights["model.embed_tokens.weight"], Q.Q8_0)
    put("token_embd.weight", weights["model.embed_tokens.weight"], Q.Q8_0)
    put("output_norm.weight", weights["model.norm.weight"])
    if not tied:
        put("output.weight", weights["lm_head.weight"])
    for i in range(LAYERS):
        for short, (hf, shape) in names.items():
            # layer 0 all F32; layer 1 quantizes its matrices (Q/K in Q8_0, the rest Q4_1)
            qtype = Q.F32 if i == 0 or len(shape) == 1 else (Q.Q8_0 if short in ("attn_q", "attn_k") else Q.Q4_1)
            value = roundtrip(w(*shape) + (1 if len(shape) == 1 else 0), qtype)
            weights[f"model.layers.{i}.{hf}.weight"] = value
            stored = {"attn_q": lambda x: llama_cpp_permute(x, HEADS),
                      "attn_k": lambda x: llama_cpp_permute(x, KV_HEADS)}.get(short, lambda x: x)(value)
            put(f"blk.{i}.{short}.weight", stored, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyModel(path, weights, reference)
