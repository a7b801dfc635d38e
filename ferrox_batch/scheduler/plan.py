"""`StepPlan`: what one forward holds, as the scheduler decided it.

Decoding requests come first, one token each (the token they sampled last),
then prompt chunks. After the forward, every decoding request samples, and so
does each prompt whose chunk is its last (unless it only scores its prompt): `sampling` lists them in that order,
which is the order the runner returns sampled ids in.

A plan is a snapshot: its inputs and who samples are fixed when it is made,
so reading it after `update` moved its requests on still says what ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from ferrox_batch.errors import DecodeError
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.scheduler.request import Request



@dataclass(frozen=True, slots=True)
class GrammarComplete:
    """The request's last token: its grammar is complete after it (it finishes with `stop`)."""

    token: int | TokenLogprob


#: What the runner returns for one sampling request: a token id (with its log-probabilities, as a
#: `TokenLogprob`, when the request asked for them; wrapped in `GrammarComplete` when it completes the
#: request's grammar), or the error that stops that request.
Sampled = Union[int, TokenLogprob, GrammarComplete, DecodeError]


@dataclass(frozen=True, slots=True)
class PromptChunk:
    """`tokens` of `request`'s prompt, starting at its `num_computed_tokens`; `last` when they finish it."""

    request: Request
    tokens: list[int]
    last: bool

    @classmethod
    def of(cls, request: Request, tokens: list[int]) -> PromptChunk:
        return cls(request, tokens, len(tokens) >= request.prefill_remaining())


@dataclass(frozen=True, slots=True)
class StepPlan:
    decodes: tuple[Request, ...]
    prompts: tuple[PromptChunk, ...]
    #: `(seq_id, tokens)` of every sequence in the forward, decodes first, in plan order.
    inputs: tuple[tuple[int, list[int]], ...]
    #: The requests that sample after this forward, in the order the runner answers them.
    sampling: tuple[Request, ...]
    #: The forward's row of each sampling request (decodes are rows 0..; a prompt samples from its own row).
    sampling_rows: tuple[int, ...]

    @classmethod
    def build(cls, decodes: list[Request], prompts: list[PromptChunk]) -> StepPlan:
        inputs: list[tuple[int, list[int]]] = []
        for request in decodes:
            assert request.seq_id is not None and request.output_ids
            inputs.append((request.seq_id, [request.output_ids[-1]]))
        for chunk in prompts:
            assert chunk.request.seq_id is not None
            inputs.append((chunk.request.seq_id, chunk.tokens))
        last = [i for i, chunk in enumerate(prompts) if chunk.last and chunk.request.samples]
        sampling = [*decodes, *(prompts[i].request for i in last)]
        rows = [*range(len(decodes)), *(len(decodes) + i for i in last)]
        return cls(tuple(decodes), tuple(prompts), tuple(inputs), tuple(sampling), tuple(rows))

    @classmethod
    def nothing(cls) -> StepPlan:
        return cls((), (), (), (), ())

    @property
    def empty(self) -> bool:
        return not self.inputs

    @property
    def prompt_tokens(self) -> int:
        return sum(len(chunk.tokens) for chunk in self.prompts)

    @property
    def requests(self) -> list[Request]:
        return [*self.decodes, *(chunk.request for chunk in self.prompts)]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What the runner made of a plan: one outcome per sampling request (`plan.sampling` order), and, by
    index into `plan.prompts`, the log-probabilities of the prompt tokens each chunk predicts for the
    requests that asked for them."""

    sampled: list[Sampled]
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
