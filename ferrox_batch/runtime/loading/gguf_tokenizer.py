"""A llama.cpp GGUF's tokenizer, rebuilt as a `tokenizers` tokenizer.

`gguf_convert` calls this with the file's metadata: the vocabulary, merges, scores, token types and
pre-tokenizer name become `tokenizer.json` and `tokenizer_config.json` (with the chat template the file
carries), and the end-of-generation ids the generation config lists. Two kinds of vocabulary:

* byte-level BPE (`tokenizer.ggml.model` "gpt2"), split before merging as llama.cpp's
  `tokenizer.ggml.pre` names: default/gpt2/gpt-2, smollm, llama-bpe (Llama 3, SmolLM3), qwen2 (Qwen2, Qwen3:
  Llama 3's split with single digits), gpt-4o (Phi-4-mini);
* SentencePiece (`tokenizer.ggml.model` "llama": Gemma 3, Phi-3, Llama 2), and Gemma 4's BPE over
  SentencePiece-style text ("gemma4"), built by `gguf_sentencepiece`.

Each is built as transformers' GGUF loader builds it, so the two encode a text to the same ids; anything
else is a `ModelLoadError` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.loading.gguf_sentencepiece import gemma4_tokenizer, sentencepiece_tokenizer
from ferrox_batch.runtime.loading.tokenizer import byte_level_alphabet

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# Texts llama.cpp treats as end-of-generation when the vocabulary has them as
# control tokens; SmolLM2 ends a turn with <|im_end|> but may emit <|endoftext|>.
_END_OF_GENERATION_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>",
                            "<|end|>", "<end_of_turn>", "<|end_of_text|>", "<eos>", "<turn|>", "<|tool_response>")

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's: Llama 3's, but every digit on its own.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: llama.cpp's pre-tokenizer names -> the split they stand for (before the byte-level mapping).
_SPLITS: Mapping[str, str] = MappingProxyType({
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT), "gpt-4o": _GPT4O_SPLIT})
#: The names for GPT-2's own split: "gpt-2" is llama.cpp's (its converter writes it for a GPT-2 tokenizer).
_GPT2_NAMES = ("default", "gpt2", "gpt-2")
SUPPORTED_PRE_TOKENIZERS = (*_GPT2_NAMES, "smollm", *_SPLITS)


def tokenizer_from_metadata(meta: dict[str, Any], config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError("the file has no tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"{len(types)} token types for {len(tokens)} tokens")
    if len(tokens) > config["vocab_size"]:
        raise ModelLoadError(f"the tokenizer has {len(tokens)} tokens but the embedding {config['vocab_size']} rows")
    if kind == "gpt2":
        tok = _byte_level_bpe(meta, tokens, types)
    elif kind == "llama":
        scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        if len(scores) != len(tokens):
            raise ModelLoadError(f"{len(scores)} token scores for {len(tokens)} tokens")
        tok = sentencepiece_tokenizer(tokens, scores, types, arch=str(meta.get("general.architecture")),
                                      add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
                                      unknown=_text_of(meta, tokens, "unknown"))
    elif kind == "gemma4":
        merges = meta.get("tokenizer.ggml.merges")
        if not merges:
            raise ModelLoadError("the file has no tokenizer.ggml.merges, which llama.cpp's gemma4 vocabulary needs")
        tok = gemma4_tokenizer(tokens, types, list(merges), unknown=_text_of(meta, tokens, "unknown"))
    else:
        raise ModelLoadError(f"tokenizer model {kind!r} is not supported "
                             f"(supported: gpt2, byte-level BPE; llama, SentencePiece; gemma4)")

    bos, eos = _text_of(meta, tokens, "bos"), _text_of(meta, tokens, "eos")
    # llama.cpp adds Gemma 4's BOS whatever the file says.
    add_bos = (kind == "gemma4" or bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        head, tail = [bos] * add_bos, [eos] * add_eos
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join([*head, "$A", *tail]), pair=" ".join([*head, "$A", *tail, *head, "$B:1", *tail]),
            special_tokens=[(t, tok.token_to_id(t)) for t in {*head, *tail}])
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos, "add_eos_token": add_eos,
        "bos_token": bos, "eos_token": eos,
        "unk_token": _text_of(meta, tokens, "unknown"), "pad_token": _text_of(meta, tokens, "padding"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if meta.get("tokenizer.chat_template"):
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    return tok.to_str(), tokenizer_config


def _text_of(meta: dict[str, Any], tokens: list[str], field: str) -> str | None:
    index = meta.get(f"tokenizer.ggml.{field}_token_id")
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    spelling = {byte: char for char, byte in byte_level_alphabet().items()}
    alphabet = set(spelling.values())
    # llama.cpp sometimes stores a token as raw text rather than in the byte
    # alphabet; BPE needs every token spelled in the alphabet.
    vocab = {tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
             for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False,
                               byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel
    # (transformers skips those too); adding it would grow the vocabulary.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])
    return tok


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """How text is split before BPE, per llama.cpp's `tokenizer.ggml.pre` name.

    "smollm" isolates every digit before the GPT-2 split, as llama.cpp and the
    original SmolLM2 tokenizer.json do. (transformers' GGUF loader has no entry
    for "smollm" and falls back to plain GPT-2; the two differ only when a run
    of whitespace precedes a digit.)
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _GPT2_NAMES:
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    raise ModelLoadError(f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})")


def eog_ids(meta: dict[str, Any]) -> list[int]:
    """eos first, then eot/eom, then control tokens llama.cpp knows as end-of-generation."""
    tokens, types = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.token_type") or []
    ids = [int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in ("eos", "eot", "eom")
           if meta.get(f"tokenizer.ggml.{k}_token_id") is not None]
    ids += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _CONTROL and t in _END_OF_GENERATION_TEXTS]
    return list(dict.fromkeys(ids))
