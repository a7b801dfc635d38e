"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model` "llama") as a `tokenizers` BPE tokenizer.

llama.cpp stores a SentencePiece model as its pieces, their scores and their types (`<0xNN>` byte
pieces for byte fallback, `\u2581` for a space), with no merges. SentencePiece's BPE merges the adjacent
pair whose union is the best-ranked piece; a `tokenizers` BPE does the same from a merge list ranked
the same way, so the merges are rebuilt from the vocabulary: every split of a piece into two pieces
that are both in the vocabulary, ranked by the piece's rank. This is how transformers' GGUF loader
builds these tokenizers, and we build them as it does, so that both encode a text to the same ids:

* Gemma (3): pieces ranked by their position in the file (its user-defined pieces carry a flat score
  of -1000 that is not their rank), pieces of only spaces respelled with `\u2581`, spaces replaced by
  `\u2581` and no prefix space (the file says `add_space_prefix` false);
* Phi-3: a `\u2581` prepended to the text by the normalizer; Llama 2 and the rest: `\u2581` prepended
  to the first piece of text by the pre-tokenizer (`Metaspace`), when `add_space_prefix` (llama.cpp's
  default for these files) is true; ranks from the scores.

Control and unknown pieces become special tokens and user-defined ones added tokens (matched whole,
as llama.cpp matches them).

Gemma 4's vocabulary (`tokenizer.ggml.model` "gemma4") is the same kind of text, BPE over `\u2581`-spelled
spaces with `<0xNN>` byte fallback, but stored with its merges, which llama.cpp ranks in the file's order
(`gemma4_tokenizer`); it splits only runs of newlines from the rest before merging, and adds no prefix space.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # llama.cpp token types
SPACE = "\u2581"


def sentencepiece_tokenizer(tokens: list[str], scores: list[float], types: list[int], *, arch: str,
                            add_space_prefix: bool, unknown: str | None) -> Tokenizer:
    gemma = arch.startswith("gemma")
    if gemma:
        # Gemma's pieces of two or more spaces are stored as spaces, while its text has them as U+2581.
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        # A later duplicate wins, in the ranks as in the vocabulary (as a dict built in order keeps it).
        ranks = {token: float(-index) for index, token in enumerate(tokens)}
    else:
        ranks = {token: float(score) for token, score in zip(tokens, scores)}
    vocab = {token: index for index, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges_from_ranks(vocab, ranks), unk_token=unknown,
                               fuse_unk=True, byte_fallback=True))
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", SPACE)
    elif arch == "phi3" and add_space_prefix:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, split=False,
                                                     prepend_scheme="first" if add_space_prefix else "never")
        if add_space_prefix:
            steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    _add_specials(tok, tokens, types, vocab)
    return tok


def gemma4_tokenizer(tokens: list[str], types: list[int], merges: list[str], *, unknown: str | None) -> Tokenizer:
    """Gemma 4's BPE as llama.cpp runs it (module docstring); each merge split at its first space after the
    first character, as llama.cpp splits it."""
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [(m[:m.find(" ", 1)], m[m.find(" ", 1) + 1:]) for m in merges if m.find(" ", 1) > 0]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unknown, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_specials(tok, tokens, types, vocab)
    return tok


def _add_specials(tok: Tokenizer, tokens: list[str], types: list[int], vocab: dict[str, int]) -> None:
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (_UNKNOWN, _CONTROL)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])


def merges_from_ranks(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: for each piece (best rank first), every split
    into two pieces of the vocabulary, those of one piece ordered by the pieces' ids.

    Ties keep the order of `ranks`, then shorter left pieces, then shorter right ones: the order
    transformers' `generate_merges` gives them, so the two tokenizers merge alike.
    """
    found: list[tuple[str, str, float]] = []
    for piece, rank in ranks.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                  if piece[:k] in vocab and piece[k:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found.extend((left, right, rank) for left, right in splits)
    found.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in found]
