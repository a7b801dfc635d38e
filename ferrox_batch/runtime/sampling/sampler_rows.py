"""One request's sampling state: what `BatchSampler` keeps per row, and how a row is made at admission.

A row holds its own generator (non-greedy rows: seeded from the request, or from OS entropy when it has
none), its penalty window (counts over prompt ++ generated, only when a penalty is on), its dense bias
vector (`logit_bias`, with -inf for every id outside `allowed_token_ids` and for one-token bad words;
prepared at submit in a form bounded by the lists, `PreparedBias`, and scattered when the row is made),
the bans that depend on what it generated (the stop ids until `min_tokens`, the last token of a longer
bad word once the rest of it was generated), its grammar state, and how many log-probability
alternatives it wants. Making a row checks everything that depends on the vocabulary (an
out-of-vocabulary id in the penalty window, the bias or a token list is `TokenOutOfVocab`), so a bad
request fails at admission, never mid-batch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ferrox_batch.errors import DecodeError, GrammarConstraint, TokenOutOfVocab
from ferrox_batch.generation_types import SamplingParams

if TYPE_CHECKING:
    from ferrox_batch.runtime.sampling.grammar import CompiledGrammar, Grammars

#: Below this a temperature is treated as greedy.
MIN_TEMPERATURE = 1e-5
_MAX_SEED = 2**64 - 1


class SamplingError(DecodeError):
    """A row's logits could not be sampled; `row` is its index in the batch handed to `sample`."""

    http_status = 500
    error_code = "sampling_error"
    _fields = ("row", "detail")

    def __init__(self, row: int, detail: str) -> None:
        self.row = row
        self.detail = detail
        super().__init__(f"sampling failed: {detail}")


class NoTokenLeft(DecodeError):
    """The request's own constraints (`allowed_token_ids`, `bad_words`, `logit_bias`, its grammar) left no
    token to sample at some step: its fault, a 400, and its alone."""

    http_status = 400
    error_type = "invalid_request_error"
    error_code = "no_token_left"
    _fields = ("row",)

    def __init__(self, row: int) -> None:
        self.row = row
        super().__init__("no token is left to sample: allowed_token_ids, bad_words, logit_bias or the output's "
                         "grammar ban every one")


@dataclass(slots=True, eq=False)
class RowSampler:
    """One request's sampling state, made at admission by `BatchSampler.new_row`.

    `generator` exists only for non-greedy rows; `counts` (float32 `[vocab]` on
    the device, occurrences over prompt ++ generated) only when a penalty is on.
    `seed` is the seed the generator was given (drawn from OS entropy when the
    request had none), so an unseeded answer can still be replayed.
    """

    params: SamplingParams
    generator: torch.Generator | None
    counts: torch.Tensor | None
    seed: int | None
    logprobs: int | None = None  # alternatives per token when the request asked for log-probabilities
    bias: torch.Tensor | None = None  # float32 [vocab] added to the logits (`logit_bias`), when any
    matcher: Any = None  # the request's grammar state (`runtime.sampling.grammar`), when its output is constrained
    #: Ids banned while `hold_left` tokens are still to be generated (`min_tokens`: the stop ids).
    held: tuple[int, ...] = ()
    hold_left: int = 0
    #: Bad words longer than one token: (the tokens before the last, the last), and the row's most
    #: recent generated ids (as many as the longest prefix) they are compared with.
    sequences: tuple[tuple[tuple[int, ...], int], ...] = ()
    recent: list[int] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.generator is None

    @property
    def memoryless(self) -> bool:
        """Whether what this row samples next depends on nothing it sampled before: greedy, with no penalty
        window, grammar, `min_tokens` hold or multi-token bad word. Such a row's drafted positions can be
        sampled in one call (`record` leaves its state as it was)."""
        return (self.generator is None and self.counts is None and self.matcher is None and self.hold_left == 0
                and not self.sequences)

    def banned_now(self) -> list[int]:
        """The ids this row may not sample at this step (beyond its bias vector)."""
        out = list(self.held) if self.hold_left > 0 else []
        for prefix, last in self.sequences:
            if len(self.recent) >= len(prefix) and tuple(self.recent[len(self.recent) - len(prefix):]) == prefix:
                out.append(last)
        return out

    def record(self, token: int) -> None:
        """Count `token` into the penalty window and the generated-token state (`sample` does this for the
        tokens it returns)."""
        if self.counts is not None:
            if not 0 <= token < self.counts.shape[0]:
                raise ValueError(f"token {token} is outside the vocabulary of {self.counts.shape[0]}")
            self.counts[token] += 1
        if self.hold_left > 0:
            self.hold_left -= 1
        if self.sequences:
            self.recent.append(token)
            longest = max(len(prefix) for prefix, _ in self.sequences)
            del self.recent[:-longest]


def _penalised(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def new_row(params: SamplingParams, seed: int | None, prompt_ids: Sequence[int], vocab_size: int,
            device: torch.device, logprobs: int | None = None, grammar: CompiledGrammar | None = None,
            grammars: Grammars | None = None, held: Sequence[int] = (), hold_for: int = 0,
            prepared: PreparedBias | None = None) -> RowSampler:
    """The state for one admitted request; `prompt_ids` opens its penalty window; `logprobs`: how many
    alternatives its tokens' log-probabilities carry (None: it gets none); `grammar`: the compiled
    grammar its output must follow (`Grammars.compile`, at submit), matched with `grammars`; `held`:
    ids it may not sample for its first `hold_for` tokens (ids past the vocabulary are never sampled
    anyway, and are dropped); `prepared`: its bias as `prepare_bias` compacted it before admission (None:
    prepared here)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {params!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED):
        raise ValueError(f"seed must be None or an integer in [0, 2**64 - 1], got {seed!r}")
    generator = None
    if params.temperature >= MIN_TEMPERATURE:
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    else:
        seed = None
    counts = None
    if _penalised(params):
        ids = list(prompt_ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise TokenOutOfVocab(bad[0], vocab_size)
        counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if ids:
            # index_add_, not bincount: bincount on CUDA syncs to size its output.
            index = torch.tensor(ids, dtype=torch.long, device=device)
            counts.index_add_(0, index, torch.ones(len(ids), dtype=torch.float32, device=device))
    if prepared is None:
        prepared = prepare_bias(params, vocab_size)
    elif prepared.vocab_size != vocab_size:  # checked when it was prepared: here only one scatter, no per-id work
        raise ValueError(f"a prepared bias must be for a vocabulary of {vocab_size}, not {prepared.vocab_size}")
    bias = dense_bias(prepared, device)
    sequences = tuple((word[:-1], word[-1]) for word in params.bad_words_ids if len(word) > 1)
    matcher = None
    if grammar is not None:
        if grammars is None:
            raise GrammarConstraint("this sampler has no grammar engine")
        matcher = grammars.matcher(grammar)  # a copy of the compiled grammar: microseconds, never a compile
    held_ids = tuple(sorted({t for t in held if 0 <= t < vocab_size})) if hold_for > 0 else ()
    return RowSampler(params, generator, counts, seed, logprobs, bias, matcher, held_ids,
                      hold_for if held_ids else 0, sequences)


@dataclass(frozen=True, slots=True)
class PreparedBias:
    """A request's bias as it waits for admission, in a form bounded by its own lists, not the vocabulary:
    every id is `fill` (0, or -inf when the request has an allowed list) but `ids` (sorted, unique, int32 on
    the host), which are `values` (float32). Built on the caller's thread (`prepare_bias`) and shared by a
    request's choices; each admitted row scatters it into its own dense `[vocab_size]` vector
    (`dense_bias`), in one write. `ids` None: the request has no bias."""

    vocab_size: int
    fill: float = 0.0
    ids: torch.Tensor | None = None
    values: torch.Tensor | None = None


def prepare_bias(params: SamplingParams, vocab_size: int) -> PreparedBias:
    """The compact bias of a request's rows (`compact_bias`); `TokenOutOfVocab` for an id its lists name
    past the vocabulary."""
    _check_named(params, vocab_size)
    return compact_bias(params, vocab_size)


def _check_named(params: SamplingParams, vocab_size: int) -> None:
    named = params.token_ids_named
    if named and max(named) >= vocab_size:
        raise TokenOutOfVocab(max(named), vocab_size)


def compact_bias(params: SamplingParams, vocab_size: int) -> PreparedBias:
    """`logit_bias`, then -inf outside `allowed_token_ids` and on one-token bad words, as `PreparedBias`
    holds it: with an allowed list, the allowed ids (less the banned ones) with their bias or 0 over a fill
    of -inf; without, the biased and banned ids over a fill of 0. At most one entry per id the lists name.
    Its cost grows with the lists, so `ContinuousBatcher.submit` calls it on the caller's thread
    (`BatchSampler.prepare_bias`), once for a request's choices."""
    one_token_words = [word[0] for word in params.bad_words_ids if len(word) == 1]
    if not params.logit_bias and params.allowed_token_ids is None and not one_token_words:
        return PreparedBias(vocab_size)  # most requests: nothing to build, not even an empty tensor
    banned = torch.tensor(one_token_words, dtype=torch.int64)
    pairs = tuple(zip(*params.logit_bias)) or ((), ())
    biased = torch.tensor(pairs[0], dtype=torch.int64)
    weights = torch.tensor(pairs[1], dtype=torch.float32)
    if params.allowed_token_ids is None:
        kept = ~torch.isin(biased, banned)
        banned = banned.unique()
        ids = torch.cat([biased[kept], banned])
        values = torch.cat([weights[kept], torch.full((banned.numel(),), float("-inf"))])
        fill = 0.0
    else:
        ids = torch.tensor(params.allowed_token_ids, dtype=torch.int64).unique()  # sorted
        ids = ids[~torch.isin(ids, banned)]
        values = torch.zeros(ids.numel(), dtype=torch.float32)
        if ids.numel() and biased.numel():
            at = torch.searchsorted(ids, biased).clamp_(max=ids.numel() - 1)
            hit = ids[at] == biased  # a bias on an id outside the list is overruled by its -inf
            values[at[hit]] = weights[hit]
        fill = float("-inf")
    order = ids.argsort()
    return PreparedBias(vocab_size, fill, ids[order].to(torch.int32), values[order].contiguous())


def dense_bias(prepared: PreparedBias, device: torch.device) -> torch.Tensor | None:
    """The row's float32 `[vocab_size]` bias on `device` (None: it has none): one fill and one scatter,
    whatever the lists' length."""
    if prepared.ids is None or prepared.values is None:
        return None
    bias = torch.full((prepared.vocab_size,), prepared.fill, dtype=torch.float32, device=device)
    bias[prepared.ids.to(device=device, dtype=torch.long)] = prepared.values.to(device)
    return bias
