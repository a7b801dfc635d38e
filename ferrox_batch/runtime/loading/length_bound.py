"""How few ids a text can encode to, from its length alone: what lets a server refuse a prompt unread.

A tokenizer whose every input character reaches the model, and whose every id stands for at most
`max_token_chars` characters, encodes a text of C characters to at least ceil(C / `max_token_chars`)
ids. `length_bound` works out, once at load, whether a `tokenizer.json` pipeline promises that (and
the few characters a byte-level vocabulary drops whole), from its normalizer, pre-tokenizer, model
and vocabulary; a pipeline that may drop or merge unbounded input has no bound (None).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer as HfTokenizer

#: Normalizers that never make a text shorter: each input character stays, or becomes one or more.
_GROWING_NORMALIZERS = frozenset({"Prepend", "Lowercase", "NFD", "NFKD", "ByteLevel"})
#: Pre-tokenizers that split a text without dropping any of it.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength"})
#: `Split` and `Punctuation` keep the text they split on unless told to remove it.
_KEEPING_BEHAVIOURS = frozenset({"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"})


@dataclass(frozen=True, slots=True)
class LengthBound:
    """A text of C characters encodes to at least ceil(C' / `max_token_chars`) ids, C' counting the
    characters that are not in `dropped` (those the tokenizer drops whole: byte-level vocabularies
    without a symbol for some control bytes, SmolLM2's among them, silently skip those characters)."""

    max_token_chars: int
    dropped: str = ""

    def least_tokens(self, text: str) -> int:
        kept = len(text) - sum(text.count(ch) for ch in self.dropped)
        return -(-kept // self.max_token_chars)


def length_bound(spec: Mapping[str, Any], inner: HfTokenizer, table: Sequence[bytes],
                 byte_symbols: Mapping[str, int]) -> LengthBound | None:
    """How few ids a text can encode to, or None when the pipeline can drop or merge unbounded input.

    The bound holds when every input character reaches the model (normalizers that only grow the text,
    pre-tokenizers that drop nothing, no truncation) and the model turns each piece into ids that
    cover it: BPE where every character has an id (the `<0xNN>` byte-fallback pieces, or an unknown
    token per unknown character, never fused), or byte-level BPE, where a character whose bytes
    all lack a symbol is dropped (only single-byte characters can be, when every continuation byte
    has one; otherwise no bound). An id then covers at most as many characters as its vocabulary
    string has, or bytes it decodes to (a character is one byte or more), and an added token its
    content. Added tokens that swallow the whitespace beside them (`lstrip`, `rstrip`) cover
    unbounded text: no bound then either.
    """
    model = spec.get("model") or {}
    if spec.get("truncation") or model.get("type") != "BPE":
        return None
    if not _grows(spec.get("normalizer")) or not _keeps(spec.get("pre_tokenizer")):
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None  # pieces are looked up with affixes: per-character coverage is not the vocabulary's
    vocab = inner.get_vocab(with_added_tokens=True)
    added = list(inner.get_added_tokens_decoder().values())
    if any(t.lstrip or t.rstrip for t in added):
        return None
    dropped = ""
    if model.get("byte_fallback"):
        covered = all(f"<0x{b:02X}>" in vocab for b in range(256))
    elif "ByteLevel" in _kinds(spec.get("pre_tokenizer")) | _kinds(spec.get("normalizer")):
        missing = {b for ch, b in byte_symbols.items() if ch not in vocab}
        covered = not missing & set(range(0x80, 0xC0))
        dropped = "".join(chr(b) for b in sorted(missing) if b < 0x80)
    else:
        covered = model.get("unk_token") is not None and not model.get("fuse_unk")
    if not covered:
        return None
    longest = max((max(len(text), len(table[index])) for text, index in vocab.items()), default=1)
    return LengthBound(max(longest, *(len(t.content) for t in added), 1), dropped)


def _kinds(component: Mapping[str, Any] | None) -> set[str]:
    """The `type`s of a normalizer or pre-tokenizer and of everything in its `Sequence`s."""
    if not component:
        return set()
    kinds = {component.get("type", "")}
    for inner in component.get("normalizers") or component.get("pretokenizers") or []:
        kinds |= _kinds(inner)
    return kinds


def _grows(normalizer: Mapping[str, Any] | None) -> bool:
    """Whether `normalizer` never shortens a text."""
    if not normalizer:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_grows(n) for n in normalizer.get("normalizers") or [])
    if kind == "Replace":  # a literal replaced by one at least as long; a regex may match any length
        pattern = (normalizer.get("pattern") or {}).get("String")
        return isinstance(pattern, str) and 0 < len(pattern) <= len(normalizer.get("content") or "")
    return kind in _GROWING_NORMALIZERS


def _keeps(pre_tokenizer: Mapping[str, Any] | None) -> bool:
    """Whether `pre_tokenizer` passes every character on."""
    if not pre_tokenizer:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps(p) for p in pre_tokenizer.get("pretokenizers") or [])
    if kind in ("Split", "Punctuation"):
        return pre_tokenizer.get("behavior", "Isolated") in _KEEPING_BEHAVIOURS
    return kind in _KEEPING_PRE_TOKENIZERS
