"""Log-probabilities in OpenAI's two wire shapes: the legacy completions object and chat's `content` list.

* Completions: `{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
  "text_offset": [...]}`, one entry per generated token (with `echo`, first one per prompt token, the
  first of them with nulls: nothing predicts it); `text_offset` is where each token's text starts in the
  choice's text (a stream continues the count from chunk to chunk).
* Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
  "refusal": null}`.
* vLLM's `prompt_logprobs` (both endpoints): one entry per prompt token, `null` for the first (nothing
  predicts it), then `{"<id>": {"logprob", "rank", "decoded_token"}}` holding the prompt's token (with its
  rank in the vocabulary) and the k likeliest (ranks 1 to k).

A token's text is what the tokenizer gives for it alone (a token holding part of a UTF-8 character shows
U+FFFD, its `bytes` hold the exact bytes). JSON has no infinities, so a log-probability of -inf (a token
the model rules out) is written as `FLOOR`, as vLLM does.

A whole answer asks for its lists `lazy`: the per-token objects (a dict and a list per alternative) are
then made a slice at a time as the JSON text reaches them (`json_body.Slices`), never all at once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.prompt_logprobs import entry_at
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.server.http.json_body import SLICE_CONTAINERS, Slices

#: What -inf (and anything below it) is written as.
FLOOR = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > FLOOR else FLOOR


class LogprobShapes:
    """One request's writer: it remembers each token's text and the completion's running text offset."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, tuple[str, bytes]] = {}
        self._offset = 0

    def _token(self, token: int) -> tuple[str, bytes]:
        known = self._texts.get(token)
        if known is None:
            raw = self._tokenizer.decode([token])
            known = self._texts[token] = (raw.decode("utf-8", errors="replace"), raw)
        return known

    def text(self, token: int) -> str:
        """A token's text alone (U+FFFD for part of a character)."""
        return self._token(token)[0]

    def chat(self, entries: Sequence[TokenLogprob], *, lazy: bool = False) -> dict[str, Any]:
        return {"content": _sliced(self._chat_entries, entries) if lazy else self._chat_entries(entries),
                "refusal": None}

    def completion(self, entries: Sequence[TokenLogprob | int], *, lazy: bool = False) -> dict[str, Any]:
        """An `int` entry is a token with no log-probability (an echoed prompt's first): nulls for it."""
        tokens, offsets = [], []
        for e in entries:
            text, _ = self._token(e if isinstance(e, int) else e.token)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens,
                "token_logprobs": [None if isinstance(e, int) else finite(e.logprob) for e in entries],
                "top_logprobs": _sliced(self._tops, entries) if lazy else self._tops(entries),
                "text_offset": offsets}

    def _chat_entries(self, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        def one(token: int, logprob: float) -> dict[str, Any]:
            text, raw = self._token(token)
            return {"token": text, "logprob": finite(logprob), "bytes": list(raw)}

        return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]

    def _tops(self, entries: Sequence[TokenLogprob | int]) -> list[dict[str, float] | None]:
        return [None if isinstance(e, int) else {self._token(t)[0]: finite(lp) for t, lp in e.top} for e in entries]


def _sliced(shape: Callable[[Sequence[Any]], list[Any]], entries: Sequence[Any]) -> Slices:
    """`shape(entries)`, made `SLICE_CONTAINERS` entries at a time as it is written."""
    return Slices(shape(entries[at:at + SLICE_CONTAINERS]) for at in range(0, len(entries), SLICE_CONTAINERS))


def prompt_logprob_entries(shapes: LogprobShapes, entries: Sequence[TokenLogprob | None], top: int) -> Slices:
    """vLLM's `prompt_logprobs` list of a prompt's entries, `top` alternatives each, made a slice at a time as
    it is written (a prompt's entries are held as arrays until then: `PromptLogprobs`)."""
    return _sliced(lambda part: [_prompt_entry(shapes, entry, top) for entry in part], entries)


def _prompt_entry(shapes: LogprobShapes, entry: TokenLogprob | None, top: int) -> dict[str, Any] | None:
    if entry is None:
        return None
    one = {str(entry.token): {"logprob": finite(entry.logprob), "rank": entry.rank,
                              "decoded_token": shapes.text(entry.token)}}
    for rank, (token, logprob) in enumerate(entry.top[:top], start=1):
        one.setdefault(str(token), {"logprob": finite(logprob), "rank": rank, "decoded_token": shapes.text(token)})
    return one


class EchoEntries(Sequence[TokenLogprob | int]):
    """Completions' `echo` with `logprobs`: the prompt's first id (nothing predicts it), the prompt's other
    entries with at most `top` alternatives, then the generated tokens' entries, each made when read."""

    __slots__ = ("_first", "_prompt", "_top", "_generated")

    def __init__(self, first: int, prompt: Sequence[TokenLogprob | None], top: int,
                 generated: Sequence[TokenLogprob]) -> None:
        self._first = first
        self._prompt = prompt
        self._top = top
        self._generated = generated

    def __len__(self) -> int:
        return len(self._prompt) + len(self._generated)

    def _entry(self, i: int) -> TokenLogprob | int:
        if i == 0:
            return self._first
        if i < len(self._prompt):
            entry = self._prompt[i]
            assert entry is not None  # only a prompt's first entry is None
            return entry if len(entry.top) <= self._top else dataclasses.replace(entry, top=entry.top[:self._top])
        return self._generated[i - len(self._prompt)]

    def __getitem__(self, index: int | slice) -> Any:
        return entry_at(index, len(self), self._entry)


def echo_entries(first: int, prompt: Sequence[TokenLogprob | None], top: int,
                 generated: Sequence[TokenLogprob]) -> EchoEntries:
    """`EchoEntries` of a prompt whose first id is `first` (`prompt` holds its None, then an entry per token)."""
    return EchoEntries(first, prompt if prompt else (None,), top, generated)
