"""A prompt's log-probabilities are written a slice at a time: the per-entry objects (a `TokenLogprob`,
its dicts) are made only as the JSON text reaches them, never all at once.

Pins, over a `PromptLogprobs` that counts the entries read: building vLLM's `prompt_logprobs` and
completions' echoed entries reads none; writing them reads each once, never more than a slice ahead of
the text; and the text is what the eager shapes write.
"""

from __future__ import annotations

import json

from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.prompt_logprobs import PromptLogprobs
from ferrox_batch.server.http.json_body import SLICE_CONTAINERS, json_pieces
from ferrox_batch.server.openai.logprob_shapes import LogprobShapes, echo_entries, prompt_logprob_entries

TOP = 3


class Counted(PromptLogprobs):
    __slots__ = ("reads",)

    def __init__(self, top: int, leading: int = 0) -> None:
        super().__init__(top, leading)
        self.reads = 0

    def _entry(self, i: int) -> TokenLogprob | None:
        self.reads += 1
        return super()._entry(i)


class Letters:
    """A tokenizer stand-in: each id is one letter."""

    def decode(self, ids):
        return bytes(97 + i % 26 for i in ids)


def entries(n: int) -> Counted:
    out = Counted(TOP, leading=1)
    out.extend(TokenLogprob(i % 50, -0.5 - i / n, tuple((j, -0.1 * (j + 1)) for j in range(TOP)), 1 + i % 7)
               for i in range(n - 1))
    return out


def test_prompt_logprobs_are_made_as_they_are_written():
    prompt = entries(1000)
    shaped = prompt_logprob_entries(LogprobShapes(Letters()), prompt, TOP)
    assert prompt.reads == 0
    pieces = json_pieces({"prompt_logprobs": shaped})
    written = ""
    while "null" not in written:  # the first slice
        written += next(pieces)
    assert written.startswith('{"prompt_logprobs":[null')
    assert prompt.reads <= SLICE_CONTAINERS
    text = written + "".join(pieces)
    assert prompt.reads == len(prompt)
    eager = [None] + [{str(e.token): {"logprob": e.logprob, "rank": e.rank, "decoded_token": chr(97 + e.token % 26)},
                       **{str(t): {"logprob": lp, "rank": r, "decoded_token": chr(97 + t % 26)}
                          for r, (t, lp) in enumerate(e.top, start=1) if t != e.token}}
                      for e in list(prompt)[1:]]
    assert json.loads(text) == {"prompt_logprobs": eager}


def test_echoed_entries_are_a_view_made_entry_by_entry():
    prompt = entries(500)
    generated = [TokenLogprob(5, -1.0, ((5, -1.0),), 1)]
    view = echo_entries(42, prompt, 1, generated)
    assert prompt.reads == 0 and len(view) == 1 + 499 + 1
    assert view[0] == 42 and view[-1] == generated[0]
    assert view[1] == TokenLogprob(prompt[1].token, prompt[1].logprob, prompt[1].top[:1], prompt[1].rank)
    prompt.reads = 0
    part = view[100:164]
    assert len(part) == 64 and prompt.reads == 64
