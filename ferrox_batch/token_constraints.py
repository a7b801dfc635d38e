"""Which tokens a request may sample: `allowed_token_ids` and `bad_words`, their limits and their ids.

Both are vLLM's request fields with vLLM's meaning:

* `allowed_token_ids`: only these ids may be sampled (every other logit is -inf). Not empty.
* `bad_words`: words the output must never contain. Each word is tokenized as it stands (leading spaces
  stripped) and, where that spells it differently, with one leading space (the word in mid-text); a
  sequence's last token is banned whenever the tokens generated just before it are the rest of the
  sequence. Only generated tokens count as that prefix, never the prompt's, so a one-token word is banned
  everywhere and a longer one only once the model has started to spell it.

The sampler applies them (`runtime.sampling`): static bans fold into the row's bias vector, and the
prefix-dependent ones are one masked write per step over the rows that have any. Their sizes are bounded
here, on the caller's thread, so a request cannot make the worker's per-step checks long.
Shared vocabulary (no torch, no scheduler), so any layer can quote them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ferrox_batch.errors import InvalidRequest

__all__ = ["MAX_BAD_WORDS", "MAX_BAD_WORD_TOKENS", "MAX_BAD_WORD_CHARS", "bad_words_ids", "check_token_lists"]

#: Bad words per request. Each word is up to two token sequences the worker compares with the row's last
#: generated tokens every step; 64 words is a long blocklist for one request.
MAX_BAD_WORDS = 64
#: Characters per bad word: a word or a short phrase.
MAX_BAD_WORD_CHARS = 128
#: Tokens per spelling of a bad word: the longest generated suffix the worker compares.
MAX_BAD_WORD_TOKENS = 32


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_token_lists(allowed_token_ids: tuple[int, ...] | None,
                      bad_words_ids: tuple[tuple[int, ...], ...]) -> None:
    """Raise `InvalidRequest` naming the field for a malformed or oversized list (ids must be integers >= 0;
    the vocabulary bound is the batcher's to check, where the vocabulary is known)."""
    if allowed_token_ids is not None:
        if not isinstance(allowed_token_ids, tuple) or not allowed_token_ids:
            raise InvalidRequest("allowed_token_ids", allowed_token_ids, "must be a non-empty list of token ids")
        bad = next((t for t in allowed_token_ids if not _is_id(t)), None)
        if bad is not None:
            raise InvalidRequest("allowed_token_ids", bad, "entries must be integers >= 0")
    if not isinstance(bad_words_ids, tuple):
        raise InvalidRequest("bad_words", bad_words_ids, "must be a list of token sequences")
    if len(bad_words_ids) > 2 * MAX_BAD_WORDS:
        raise InvalidRequest("bad_words", len(bad_words_ids), f"may hold at most {MAX_BAD_WORDS} words")
    for sequence in bad_words_ids:
        if not isinstance(sequence, tuple) or not 1 <= len(sequence) <= MAX_BAD_WORD_TOKENS:
            raise InvalidRequest("bad_words", sequence,
                                 f"each word must be 1 to {MAX_BAD_WORD_TOKENS} tokens")
        bad = next((t for t in sequence if not _is_id(t)), None)
        if bad is not None:
            raise InvalidRequest("bad_words", bad, "token ids must be integers >= 0")


def bad_words_ids(words: Sequence[str], encode: Callable[[str], Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """The token sequences `words` are banned as: each word stripped of leading spaces, and with one leading
    space where that is as many tokens and starts with another token. Words are checked (count, length,
    type) before anything is tokenized."""
    if isinstance(words, str) or not isinstance(words, Sequence):
        raise InvalidRequest("bad_words", words, "must be a list of strings")
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequest("bad_words", len(words), f"may hold at most {MAX_BAD_WORDS} words")
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise InvalidRequest("bad_words", word, "entries must be non-empty strings")
        if len(word) > MAX_BAD_WORD_CHARS:
            raise InvalidRequest("bad_words", word, f"entries must be at most {MAX_BAD_WORD_CHARS} characters")
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        for sequence in (plain, spaced):
            if len(sequence) > MAX_BAD_WORD_TOKENS:
                raise InvalidRequest("bad_words", word, f"entries must be at most {MAX_BAD_WORD_TOKENS} tokens")
        if plain and plain not in out:
            out.append(plain)
        if spaced and len(spaced) == len(plain) and spaced[0] != plain[0] and spaced not in out:
            out.append(spaced)
    return tuple(out)
