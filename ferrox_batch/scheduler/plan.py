"""`StepPlan`: what one forward holds, as the scheduler decided it (and, through `forward()`, as the runtime
reads it: `ferrox_batch.forward`).

Decoding requests come first, one token each (the token they sampled last), followed by the
request's draft when it speculates (`speculation`), then prompt chunks. After the forward, every decoding request samples, and so
does each prompt whose chunk is its last (unless it only scores its prompt): `sampling` lists them in that order,
which is the order the runner returns sampled ids in.

A plan is a snapshot: its inputs and who samples are fixed when it is made,
so reading it after `update` moved its requests on still says what ran.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferrox_batch.forward import ForwardPlan, PromptToPool, PromptToScore, RowToSample
from ferrox_batch.scheduler.request import Request


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
    #: The decodes' draft tokens in all (`speculation`): 0 in a step without drafts.
    draft_tokens: int = 0

    @classmethod
    def build(cls, decodes: list[Request], prompts: list[PromptChunk]) -> StepPlan:
        inputs: list[tuple[int, list[int]]] = []
        drafts = 0
        for request in decodes:
            assert request.seq_id is not None and request.output_ids
            inputs.append((request.seq_id, [request.output_ids[-1], *request.draft]))
            drafts += len(request.draft)
        for chunk in prompts:
            assert chunk.request.seq_id is not None
            inputs.append((chunk.request.seq_id, chunk.tokens))
        last = [i for i, chunk in enumerate(prompts) if chunk.last and chunk.request.samples]
        sampling = [*decodes, *(prompts[i].request for i in last)]
        rows = [*range(len(decodes)), *(len(decodes) + i for i in last)]
        return cls(tuple(decodes), tuple(prompts), tuple(inputs), tuple(sampling), tuple(rows), drafts)

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

    def forward(self) -> ForwardPlan:
        """What the runtime needs of this plan (`ferrox_batch.forward`), read before `update` moves its
        requests on: each sampling row's settings, and which prompt tokens each scored chunk predicts."""
        assert all(r.seq_id is not None for r in self.sampling)
        decoding = len(self.decodes)
        sampling = tuple(
            RowToSample(r.seq_id, row, r.params.sampling, r.params.seed, r.params.logprobs, r.prefill_tokens,
                        r.grammar, r.held_ids, r.params.min_tokens,
                        tuple(self.inputs[row][1][1:]) if self.draft_tokens and row < decoding else (), r.bias)
            for r, row in zip(self.sampling, self.sampling_rows))
        drafted = tuple(i for i, s in enumerate(sampling) if s.draft) if self.draft_tokens else ()
        scoring = []
        for index, chunk in enumerate(self.prompts):
            request = chunk.request
            if request.params.prompt_logprobs is None:
                continue
            # Row j of the chunk (position start + j) predicts the token at start + j + 1: for its last row,
            # the next chunk's first.
            prompt, start = request.prefill_tokens, request.num_computed_tokens
            count = max(0, min(len(chunk.tokens), len(prompt) - 1 - start))
            scoring.append(PromptToScore(index, len(self.decodes) + index,
                                         tuple(prompt[start + 1:start + 1 + count]), request.params.prompt_logprobs))
        pooling = tuple(PromptToPool(index, len(self.decodes) + index, chunk.request.params.pooling)
                        for index, chunk in enumerate(self.prompts) if chunk.request.params.pooling is not None)
        return ForwardPlan(self.inputs, sampling, tuple(scoring), pooling, drafted)
