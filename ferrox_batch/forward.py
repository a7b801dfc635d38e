"""What the scheduler asks of the runtime for one forward, and what it gets back: the seam between them.

The scheduler decides; the runtime computes. Neither imports the other: the scheduler turns its plan into
a `ForwardPlan` (plain ids, tokens and each sampling row's settings), and the runtime answers with a
`StepOutput`. So the scheduler is tested with a fake runner, and another runtime (another device, a
captured graph) plugs in without the scheduler changing.

* `ForwardPlan.inputs`: `(seq_id, tokens)` of every sequence in the forward, decodes first, in plan order.
* `ForwardPlan.sampling`: who samples after the forward, in the order the outcomes come back, each with
  the row of the forward its logits are on and what its sampler needs when it first samples (its
  settings, seed, the prompt that opens its penalty window, its compiled grammar). The runtime keeps each
  sequence's sampler state itself, from its first sample until its KV lease ends.
* `ForwardPlan.scoring`: the prompt chunks whose requests asked for their prompt's log-probabilities:
  which input they are and which prompt tokens their rows predict.
* `StepOutput.sampled`: one `Sampled` per sampling row: a token id (a `TokenLogprob` with its
  log-probabilities when asked; in `GrammarComplete` when it completes the row's grammar), or the
  `DecodeError` that stops that request; for a row that fed a draft (`RowToSample.draft`), a `Verified`
  tuple: its accepted draft tokens and the token after them, the first sample that disagreed with the draft.
  `StepOutput.prompt_logprobs`: by `PromptToScore.key`, the log-probabilities of the tokens each scored
  chunk predicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

from ferrox_batch.errors import DecodeError
from ferrox_batch.generation_types import SamplingParams
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.structured import CompiledSpec


@dataclass(frozen=True, slots=True)
class GrammarComplete:
    """The request's last token: its grammar is complete after it (it finishes with `stop`)."""

    token: int | TokenLogprob


#: What the runtime returns for one sampling row (module docstring).
Sampled = Union[int, TokenLogprob, GrammarComplete, DecodeError]
#: A drafted row's outcomes: one per position it kept, in order (its accepted draft tokens, then the next).
Verified = tuple[Sampled, ...]


@dataclass(frozen=True, slots=True)
class RowToSample:
    """One sequence that samples after the forward."""

    seq_id: int  # whose sampler state: made at its first sample, dropped when its lease ends
    row: int  # the forward's row its logits are on (decodes are rows 0..; a prompt samples from its own)
    sampling: SamplingParams
    seed: int | None
    logprobs: int | None  # alternatives per token when it asked for log-probabilities
    window: Sequence[int]  # the prompt that opens its penalty window (read only at its first sample)
    grammar: CompiledSpec | None  # the compiled grammar its output follows
    held: tuple[int, ...] = ()  # ids it may not sample for its first `hold_for` tokens (its stop ids)
    hold_for: int = 0  # `min_tokens` (read only at its first sample, with `window`)
    draft: tuple[int, ...] = ()  # tokens it drafted, fed after its last one: verified position by position
    #: Its bias as the runtime prepared it at submit, compactly (opaque here); None: the runtime builds it.
    bias: object = None


@dataclass(frozen=True, slots=True)
class PromptToScore:
    """A prompt chunk whose request asked for its prompt's log-probabilities."""

    key: int  # how the answer is keyed in `StepOutput.prompt_logprobs` (the scheduler's chunk index)
    input: int  # its index in `ForwardPlan.inputs`
    targets: tuple[int, ...]  # the prompt tokens its rows predict, in order (the next chunk's first included)
    top: int  # alternatives per token


@dataclass(frozen=True, slots=True)
class PromptToPool:
    """A prompt chunk whose request asked for its prompt's pooled hidden states (an embedding)."""

    key: int  # how the answer is keyed in `StepOutput.pooled` (the scheduler's chunk index)
    input: int  # its index in `ForwardPlan.inputs`
    mode: str  # "mean" (the chunk's rows summed) or "last" (its last row)


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    inputs: tuple[tuple[int, list[int]], ...]
    sampling: tuple[RowToSample, ...] = ()
    scoring: tuple[PromptToScore, ...] = ()
    pooling: tuple[PromptToPool, ...] = ()
    drafted: tuple[int, ...] = ()  # indices into `sampling` of the rows that fed a draft

    @property
    def empty(self) -> bool:
        return not self.inputs


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What the runtime made of a `ForwardPlan` (module docstring)."""

    sampled: list[Sampled | Verified]
    prompt_logprobs: dict[int, Sequence[TokenLogprob | None]] = field(default_factory=dict)
    #: By `PromptToPool.key`: the chunk's pooled final hidden states (`Decoder.forward_pooled`), as floats.
    pooled: dict[int, list[float]] = field(default_factory=dict)
