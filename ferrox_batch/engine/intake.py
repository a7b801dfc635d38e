"""A request's intake on its caller's thread: its arguments checked, and its size against what never changes.

`ContinuousBatcher.submit` runs these before it takes anything it shares
with the worker, so a request that could never run is refused without a
queue slot, an abort id or a job on the channel. Everything here reads only what is
fixed for the batcher's life (the context ceiling, the size of the whole
block budget, the grammar engine), so it is safe on any number of caller
threads at once; the only writes are the refusal counts, which the ceiling
and the budget keep under their own locks.

`submit` calls `checked_prompt` before its lifecycle refusal and
`size_request` after it, which keeps the refusal order of the module
docstring in `engine.handle`: a malformed call is refused as malformed even by
a closed batcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

from ferrox_batch.admission.block_budget import BlockBudget
from ferrox_batch.admission.kv_groups import GroupPricing
from ferrox_batch.admission.window import WindowPolicy
from ferrox_batch.cancel import CancelToken
from ferrox_batch.errors import DecodeError, GrammarConstraint, InvalidRequest, TokenOutOfVocab
from ferrox_batch.generation_types import GenerationParams
from ferrox_batch.structured import CompiledSpec, StructuredOutput


class GrammarCompiler(Protocol):
    """What compiles structured output at submit (`runtime.sampling.grammar.Grammars`)."""

    def compile(self, spec: StructuredOutput, cancel: CancelToken | None = None) -> CompiledSpec:
        """`spec` compiled for the worker (its work stops when `cancel` is cancelled)."""
        ...


@dataclass(frozen=True, slots=True)
class SizedRequest:
    """What the worker needs to know about a request's size, worked out before it is queued."""

    params: GenerationParams  # `max_tokens` clamped to the context ceiling
    positions: int  # KV positions its lease holds at once in each group it slides (or keeps whole)
    blocks: int  # KV blocks its lease takes over every group
    grammar: CompiledSpec | None  # compiled `params.structured`, or None without it
    window: WindowPolicy | None = None  # what its lease slides by; None: it holds every position


def checked_prompt(prompt_tokens: Sequence[int], params: GenerationParams, vocab_size: int) -> list[int]:
    """The prompt as a list of token ids; `InvalidRequest` for text, a non-sequence, a non-integer id, or
    `params` that are not a `GenerationParams`; `TokenOutOfVocab` for a prompt id outside `[0, vocab_size)`
    and `InvalidRequest` for a `logit_bias` id there. Every id the worker will hash, look up or index with is
    inside the vocabulary once this returns."""
    if isinstance(prompt_tokens, (str, bytes)):
        raise InvalidRequest("prompt_tokens", prompt_tokens, "must be a sequence of token ids, not text")
    try:
        prompt = list(prompt_tokens)
    except TypeError:
        raise InvalidRequest("prompt_tokens", prompt_tokens, "must be a sequence of token ids") from None
    for token in prompt:
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidRequest("prompt_tokens", token, "must hold only integer token ids")
    if not isinstance(params, GenerationParams):
        raise InvalidRequest("params", params, "must be a GenerationParams")
    if prompt and not (0 <= min(prompt) and max(prompt) < vocab_size):
        raise TokenOutOfVocab(next(t for t in prompt if not 0 <= t < vocab_size), vocab_size)
    biased = next((t for t, _ in params.sampling.logit_bias if t >= vocab_size), None)
    if biased is not None:
        raise InvalidRequest("logit_bias", biased, f"names a token id outside the model's vocabulary of {vocab_size}")
    for name, ids in (("allowed_token_ids", params.sampling.allowed_token_ids or ()),
                      ("bad_words", [t for word in params.sampling.bad_words_ids for t in word]),
                      ("stop_token_ids", params.stop_token_ids)):
        outside = next((t for t in ids if t >= vocab_size), None)
        if outside is not None:
            raise InvalidRequest(name, outside, f"names a token id outside the model's vocabulary of {vocab_size}")
    return prompt


def check_samplable(params: GenerationParams, held: Iterable[int]) -> None:
    """`InvalidRequest` when its first `min_tokens` tokens could not be sampled: every allowed id is a stop
    id banned until then, or a banned one-token bad word."""
    allowed = params.sampling.allowed_token_ids
    if allowed is None:
        return
    banned = {word[0] for word in params.sampling.bad_words_ids if len(word) == 1}
    if params.min_tokens:
        banned.update(held)
    if banned.issuperset(allowed):
        raise InvalidRequest("allowed_token_ids", list(allowed)[:8],
                             "allows only tokens that bad_words or min_tokens (the stop ids) ban")


def size_request(prompt: list[int], params: GenerationParams, budget: BlockBudget,
                 grammars: GrammarCompiler | None, window: WindowPolicy | None = None, *,
                 groups: GroupPricing | None = None) -> SizedRequest:
    """Fit `params.max_tokens` to the context ceiling, price the request in blocks, and compile its grammar.

    `groups`: the store's KV groups and the slide policy of its local ones (`admission.kv_groups`); without
    them, one group of every layer, sliding by `window` (a model whose every layer slides by one window)
    or by nothing. A request is priced at what its lease holds at once (`GroupPricing.hold`): each global
    group every one of `prompt + max_tokens` positions, each local group its prompt plus the hold bound
    when that saves blocks (`admission.window.row_hold`), else every position too.

    Raises, in this order, the ceiling's refusal of the prompt, `immovable_refusal` (context ceiling,
    then the whole block budget), and `GrammarConstraint` for structured output the batcher cannot
    follow (no grammar engine, or a schema that is invalid or past the compile limits of `runtime.sampling.grammar`).
    The compile is the whole cost of a new schema, paid here on the caller's thread: the worker only copies
    what it makes.
    """
    fitted = budget.ceiling.fit(len(prompt), params.max_tokens)
    if isinstance(fitted, DecodeError):
        raise fitted
    if fitted != params.max_tokens:
        params = params.with_max_tokens(fitted)
    requested = len(prompt) + params.max_tokens
    pricing = groups if groups is not None else GroupPricing.uniform(window)
    hold = pricing.hold(len(prompt), requested, budget.block_size)
    # The context ceiling sees every position the row computes, the ledger only what it holds at once.
    refusal = budget.immovable_refusal(requested, hold.held, blocks=hold.blocks)
    if refusal is not None:
        raise refusal
    grammar = None
    if params.structured is not None:
        if grammars is None:
            raise GrammarConstraint("this batcher has no grammar engine: build it with ContinuousBatcher.from_model")
        grammar = grammars.compile(params.structured, params.cancel)  # an invalid or costly schema is refused here
    return SizedRequest(params=params, positions=hold.held, blocks=hold.blocks, grammar=grammar, window=hold.window)
