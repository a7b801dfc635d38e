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


# ---- vocabularies and quantized tensors for the families' tiny GGUFs (tiny_gguf_families.py) --------

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp token types
SPM_CORPUS = CORPUS + ["Continuous batching keeps every request moving.", "Paged attention stores keys.",
                       "<start_of_turn>user\nHi<end_of_turn>\n", "Ελληνικά and español, ¿qué tal?"] * 5


@dataclass(slots=True)
class Vocabulary:
    """What llama.cpp writes under `tokenizer.*` for one vocabulary."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    bos: int | None = None
    eos: int | None = None
    unk: int | None = None
    pad: int | None = None
    add_bos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None

    def write(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.merges is not None:
            writer.add_token_merges(self.merges)
        for add, value in ((writer.add_bos_token_id, self.bos), (writer.add_eos_token_id, self.eos),
                           (writer.add_unk_token_id, self.unk), (writer.add_pad_token_id, self.pad)):
            if value is not None:
                add(value)
        writer.add_add_bos_token(self.add_bos)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template is not None:
            writer.add_chat_template(self.chat_template)


def bpe_vocabulary(tok: Tokenizer, pre: str, size: int, specials: list[str]) -> Vocabulary:
    """A byte-level BPE tokenizer's vocabulary, padded to `size` ids with [PADn] as llama.cpp pads it."""
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    types = [CONTROL if t in specials else NORMAL for t in tokens]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), size)]
    types += [UNUSED] * (size - len(types))
    raw_merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw_merges]
    ids = {t: i for i, t in enumerate(tokens)}
    return Vocabulary("gpt2", pre, tokens, types, merges=merges, bos=ids.get(specials[1]), eos=ids.get(specials[2]),
                      pad=ids.get(specials[0]), chat_template=CHAT_TEMPLATE)


def qwen2_tokenizer() -> Tokenizer:
    """A byte-level BPE trained behind Qwen2's split (single digits), as Qwen's tokenizer.json splits."""
    from tokenizers import Regex

    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=380, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def spm_vocabulary(size: int, *, gemma: bool) -> Vocabulary:
    """A SentencePiece-style vocabulary as llama.cpp stores one: control pieces, user-defined ones (Gemma:
    newlines and runs of spaces, stored as spaces), the 256 `<0xNN>` byte pieces, then pieces learned on a
    corpus in merge order, scored by rank; Gemma pads with `<unusedN>` control pieces."""
    from tokenizers import normalizers

    controls = (["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"] if gemma
                else ["<unk>", "<s>", "</s>", "<|end|>", "<|user|>", "<|assistant|>"])
    users = ["\n", "\n\n", "  ", "   ", "<b>"] if gemma else ["<b>"]
    learner = Tokenizer(models.BPE(byte_fallback=True))
    learner.normalizer = normalizers.Replace(" ", "\u2581")
    learner.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    fixed = len(controls) + len(users) + 256
    trainer = trainers.BpeTrainer(vocab_size=size - fixed - (8 if gemma else 0), show_progress=False)
    learner.train_from_iterator(SPM_CORPUS, trainer)
    learned = sorted(learner.get_vocab(), key=learner.get_vocab().get)
    tokens = [*controls, *users, *(f"<0x{b:02X}>" for b in range(256)), *learned]
    types = [CONTROL] * len(controls) + [USER_DEFINED] * len(users) + [BYTE] * 256 + [NORMAL] * len(learned)
    if not gemma:
        types[0] = UNKNOWN
    scores = [-1000.0] * (len(controls) + len(users)) + [0.0] * 256 + [-float(i) for i in range(len(learned))]
    padding = size - len(tokens)
    tokens += [f"<unused{i}>" for i in range(padding)]
    types += [CONTROL] * padding
    scores += [-1000.0] * padding
    ids = {t: i for i, t in enumerate(tokens)}
    if gemma:
        return Vocabulary("llama", "default", tokens, types, scores, bos=ids["<bos>"], eos=ids["<eos>"],
                          unk=ids["<unk>"], pad=ids["<pad>"], add_bos=True, add_space_prefix=False)
    return Vocabulary("llama", "default", tokens, types, scores, bos=ids["<s>"], eos=ids["</s>"], unk=ids["<unk>"],
                      pad=ids["</s>"])


def k_quant_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random but valid Q4_K or Q6_K blocks (gguf-py cannot quantize to K-quants): random quants and
    scales under a small fp16 super-block scale, so the values are of a weight's size."""
    from gguf.quants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    assert cols % block == 0, f"{qtype.name} needs rows of a multiple of {block}"
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d and dmin lead the block
        blocks[..., 0:4] = np.array([2e-4, 1e-4], dtype=np.float16).view(np.uint8)
    elif qtype == Q.Q6_K:  # d ends it
        blocks[..., -2:] = np.array([5e-5], dtype=np.float16).view(np.uint8)
    else:
        raise ValueError(f"no K-quant blocks for {qtype.name}")
    return blocks.reshape(rows, -1)


def stored(value: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(what to write, what it dequantizes to) for `value` in `qtype`; K-quants write random blocks."""
    if qtype == Q.F32:
        return value, value
    if qtype in (Q.Q4_K, Q.Q6_K):
        data = k_quant_blocks(value.shape[0], value.shape[1], qtype, rng)
    else:
        data = quantize(value, qtype)
    return data, dequantize(data, qtype).reshape(value.shape).astype(np.float32)
