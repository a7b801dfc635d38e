"""The batched sampler the worker calls once per tick: logits in, one token (or one error) per row out.

Why it exists: each decode tick yields a `[B, V']` logits tensor for rows that
asked for different sampling settings. Sampling them one by one would cost B
sorts and B host syncs; this module does the whole batch in a few vectorised
device ops and syncs once (the final `.tolist()`).

What it promises:

* Order of operations (llama.cpp / vLLM): penalties (repetition as HF's
  `RepetitionPenaltyLogitsProcessor`: seen tokens' positive logits divided,
  negative multiplied; presence: minus `presence_penalty` once seen;
  frequency: minus `frequency_penalty * count`; the window is prompt ++
  generated) -> `logit_bias` added -> greedy rows take the argmax of the penalised logits ->
  temperature -> top_k -> top_p -> min_p -> inverse-CDF draw with the row's
  own uniform number.
* Filters cut by value, so tied logits are kept or dropped together: top_k
  keeps every token >= the k-th largest logit; top_p keeps the smallest
  prefix of the sorted distribution whose preceding mass is < top_p (always
  at least one token), then every token tied with its last; min_p drops
  tokens whose probability (renormalised after top_p) is < min_p * the
  largest. The draw walks the CDF in vocabulary order, so the tie order of a
  sort never decides a token.
* A seeded row's tokens depend only on its own logits and seed, never on the
  other rows: each non-greedy row owns a `torch.Generator` on the device
  (seeded from the request, or from OS entropy when it has no seed) and draws
  exactly one uniform number per sampled token from it. On a GPU the
  batch-shaped reductions may round differently in the last bit, which can
  only matter for a draw that lands exactly on a CDF boundary.
* Temperatures below 1e-5 count as greedy (as in vLLM): dividing by them only
  overflows.
* Ids >= `vocab_size` (padding of the lm head) are never sampled.
* Log-probabilities, for the rows that ask, are `log_softmax` of the raw
  logits: the model's, before penalties, bias and every filter.
* One bad row never takes the batch down: `sample` returns `int |
  SamplingError` per row, the error for a row whose logits contain NaN or
  +inf or are all -inf; a row whose own state fails to take its token gets
  its own `InternalError`. Before that last per-row part nothing changes a
  row's state but the draw from its generator, so a caller may sample the
  rows of a failed batched call again one by one (a seeded row then draws
  once more than it would have).

How it stays cheap: greedy, temperature-only and min_p-only rows never sort
(min_p compares with the largest probability, a max), and top_k takes a
`topk`. top_p needs the sorted distribution. On the CPU, where `torch.sort`
of a 49k vocabulary costs about as much as a decode step, a row with top_k
and top_p finds the cut in its top-k when every token >= the k-th is in there
(a `topk`, no sort), and other top_p rows sort their values with numpy (values
are all the cut needs, and any sort gives the same ones); both give the
`torch.sort` path's cut bit for bit. Off the CPU every row with a cut sorts
whole with `torch.sort`, so the single sync stays the only one.

Each request's state is a `RowSampler` (`runtime.sampling.sampler_rows`, made at admission); the penalties, the
bias, grammar masks and log-probabilities are `runtime.sampling.logit_transforms`, each vectorised over the rows
that use it. This module chooses the tokens.

Grammars (`runtime.sampling.grammar`): a constrained row's mask applies after the
penalties and the bias; its grammar consumes each token it samples, and a
row whose grammar is complete after its token gets `GrammarComplete`.
Reasoning budgets (out of scope here) would plug in the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ferrox_batch.errors import DecodeError, GrammarConstraint, InternalError
from ferrox_batch.forward import GrammarComplete, Sampled
from ferrox_batch.grammar_limits import too_slow
from ferrox_batch.generation_types import SamplingParams
from ferrox_batch.runtime.sampling.logit_transforms import banned, biased, masked, penalised
from ferrox_batch.runtime.sampling.logprobs import token_logprobs
from ferrox_batch.runtime.sampling.sampler_rows import (
    MIN_TEMPERATURE,
    NoTokenLeft,
    PreparedBias,
    RowSampler,
    SamplingError,
    new_row,
    prepare_bias,
)
from ferrox_batch.runtime.sampling.sampling_cuts import cuts

if TYPE_CHECKING:
    from ferrox_batch.runtime.sampling.grammar import CompiledGrammar, Grammars
    from ferrox_batch.runtime.sampling.mask_pool import PendingMasks

    #: The constrained rows' indices and their masks being computed (`BatchSampler.start_masks`).
    StartedMasks = tuple[list[int], PendingMasks]

__all__ = ["MIN_TEMPERATURE", "BatchSampler", "RowSampler", "SamplingError"]

# Row status codes carried through the single host sync (index 0 = fine).
_PROBLEMS = (
    "",
    "the model's logits contain NaN",
    "the model's logits contain +inf",
    "every logit is -inf, so no token can be sampled",
)
#: The status of a row whose own constraints left no token (`NoTokenLeft`), past `_PROBLEMS`.
_NOTHING_LEFT = len(_PROBLEMS)


class BatchSampler:
    """Samples one token per row from a batch of logits; holds no per-request state itself."""

    def __init__(self, vocab_size: int, device: torch.device | str, grammars: Grammars | None = None) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.grammars = grammars

    def new_row(self, params: SamplingParams, seed: int | None, prompt_ids: Sequence[int],
                logprobs: int | None = None, grammar: CompiledGrammar | None = None, held: Sequence[int] = (),
                hold_for: int = 0, prepared: PreparedBias | None = None) -> RowSampler:
        """The state for one admitted request (`sampler_rows.new_row` on this sampler's vocabulary, device
        and grammar engine)."""
        return new_row(params, seed, prompt_ids, self.vocab_size, self.device, logprobs, grammar, self.grammars,
                       held, hold_for, prepared)

    def prepare_bias(self, params: SamplingParams) -> PreparedBias:
        """A request's bias for this sampler's vocabulary, checked and compacted where this is called (the
        caller's thread, at submit) and shared by the rows made with it, each of which scatters it once."""
        return prepare_bias(params, self.vocab_size)

    def grammar_masks(self, rows: Sequence[RowSampler]) -> tuple[list[int], torch.Tensor] | None:
        """(indices, `[len(indices), vocab]` allowed tokens) of the rows whose output follows a grammar; None
        when none does. Reads only the rows' grammar states, so it may run while the forward does."""
        constrained = [i for i, row in enumerate(rows) if row.matcher is not None and not row.matcher.is_stopped()]
        if not constrained or self.grammars is None:
            return None
        return constrained, self.grammars.masks([rows[i].matcher for i in constrained], self.device)

    def start_masks(self, rows: Sequence[RowSampler]) -> StartedMasks | None:
        """Start the constrained rows' masks on threads of their own (`grammar.Grammars.start_masks`), to be
        collected within the deadline by `collect_masks`; None when no row follows a grammar."""
        constrained = [i for i, row in enumerate(rows) if row.matcher is not None and not row.matcher.is_stopped()]
        if not constrained or self.grammars is None:
            return None
        return constrained, self.grammars.start_masks([rows[i].matcher for i in constrained])

    def collect_masks(self, started: StartedMasks) -> tuple[tuple[list[int], torch.Tensor] | None, dict[int, DecodeError]]:
        """The masks `start_masks` started, as `sample` takes them, for the rows whose mask came within the
        deadline (None: no such row), and the error that ends each other row (by its index in the rows): `GrammarTooSlow` for a
        late one, `GrammarConstraint` for one whose computation raised."""
        assert self.grammars is not None
        constrained, pending = started
        bits, late, failed = pending.collect()
        errors: dict[int, DecodeError] = {constrained[j]: too_slow(self.grammars.limits.mask_deadline_ms) for j in late}
        for j, bad in failed.items():
            errors[constrained[j]] = GrammarConstraint(f"computing its mask failed: {type(bad).__name__}: {bad}")
        keep = [j for j in range(len(constrained)) if constrained[j] not in errors]
        if not keep:
            return None, errors
        return ([constrained[j] for j in keep], self.grammars.unpack(bits[keep], self.device)), errors

    def sample(self, logits: torch.Tensor, rows: Sequence[RowSampler],
               masks: tuple[list[int], torch.Tensor] | None = None) -> list[Sampled]:
        """One token id per row (a `TokenLogprob` for a row that asked for log-probabilities, wrapped in
        `GrammarComplete` when it completes the row's grammar), or a `DecodeError` for a row that cannot be
        sampled (`SamplingError`) or whose grammar broke (`GrammarConstraint`).

        `masks`: `grammar_masks(rows)` computed beforehand (while the forward ran); computed here if None.

        Returned tokens are also counted into their rows' penalty windows; an
        erroring row's state is left as it was. Raises ValueError for a
        malformed call (logits not `[len(rows), >= vocab_size]` floats on this
        sampler's device).
        """
        x = self._checked(logits, rows)
        if not rows:
            return []
        # One reduction finds every problem: amax propagates NaN, is +inf with
        # any +inf, and is -inf only when the whole row is.
        top = x.amax(dim=-1)
        status = torch.where(top.isnan(), 1, torch.where(top == float("inf"), 2, torch.where(top == float("-inf"), 3, 0)))
        if masks is None and any(row.matcher is not None for row in rows):
            masks = self.grammar_masks(rows)
        shaped = masked(banned(biased(penalised(x, rows), rows), rows), masks)
        if shaped is not x:  # a row the transforms left with no token is refused, never handed token 0
            status = torch.where((status == 0) & (shaped.amax(dim=-1) == float("-inf")), _NOTHING_LEFT, status)
        tokens = self._choose(shaped, rows)
        host = torch.where(status == 0, tokens, -status).tolist()  # the one sync every call makes
        scored = [i for i, row in enumerate(rows) if row.logprobs is not None and host[i] >= 0]
        logprobs = token_logprobs(x, tokens, host, rows, scored) if scored else {}
        out: list[Sampled] = []
        for i, (token, row) in enumerate(zip(host, rows)):
            if token < 0:
                out.append(NoTokenLeft(i) if -token == _NOTHING_LEFT else SamplingError(i, _PROBLEMS[-token]))
                continue
            try:  # from here on each row's state changes: one row's failure stays its own
                row.record(token)
                outcome: Sampled = logprobs.get(i, token)
                if row.matcher is not None:
                    outcome = self._advance(row.matcher, token, outcome)
            except Exception as bad:
                outcome = InternalError(f"recording token {token} failed: {type(bad).__name__}: {bad}")
            out.append(outcome)
        return out

    @staticmethod
    def _advance(matcher: Any, token: int, outcome: Sampled) -> Sampled:
        """Feed the sampled token to the row's grammar: the outcome, marked complete when the grammar is."""
        if matcher.is_error():  # it erred computing its mask (a matcher that errs is also stopped)
            return GrammarConstraint(f"its grammar failed: {matcher.get_error()}")
        if matcher.is_stopped():  # a row finishes with the token that completes it: never sampled after
            return GrammarConstraint("the grammar was already complete")
        if not matcher.consume_token(token) or matcher.is_error():
            return GrammarConstraint(f"token {token} does not continue the grammar: {matcher.get_error()}")
        return GrammarComplete(outcome) if matcher.is_stopped() else outcome  # type: ignore[arg-type]

    def distribution(self, logits: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
        """The `[B, vocab_size]` distribution `sample` would draw from (one-hot for greedy rows).

        Draws nothing and records nothing; for tests and log-probabilities.
        """
        x = banned(biased(penalised(self._checked(logits, rows), rows), rows), rows)
        out = torch.zeros_like(x)
        if not rows:
            return out
        out.scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
        sampled = [i for i, row in enumerate(rows) if not row.greedy]
        if sampled:
            index = torch.tensor(sampled, device=x.device)
            weights = self._weights(x.index_select(0, index), [rows[i].params for i in sampled])
            out.index_copy_(0, index, weights / weights.sum(dim=-1, keepdim=True))
        return out

    def _checked(self, logits: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"logits must be a [rows, vocab] tensor, got {shape}")
        if logits.shape[0] != len(rows):
            raise ValueError(f"logits have {logits.shape[0]} rows but {len(rows)} row samplers were given")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than the vocabulary of {self.vocab_size}")
        if not logits.is_floating_point():
            raise ValueError(f"logits must be floating point, got {logits.dtype}")
        dev = logits.device
        if dev.type != self.device.type or None not in (dev.index, self.device.index) and dev.index != self.device.index:
            raise ValueError(f"logits are on {dev} but this sampler runs on {self.device}")
        # Padded lm-head columns are cut here, so no later step can pick them.
        return logits[:, : self.vocab_size].float()

    def _choose(self, x: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
        sampled = [i for i, row in enumerate(rows) if not row.greedy]
        if not sampled:
            return x.argmax(dim=-1)  # the all-greedy fast path: no sort, no draw
        every = len(sampled) == len(rows)
        index = None if every else torch.tensor(sampled, device=x.device)
        weights = self._weights(x if index is None else x.index_select(0, index), [rows[i].params for i in sampled])
        # One draw per row from the row's own generator: the only per-row work,
        # and what keeps a seeded row independent of its neighbours.
        u = torch.cat([torch.rand(1, generator=rows[i].generator, device=x.device) for i in sampled])
        cdf = weights.cumsum(dim=-1)
        total = cdf[:, -1:]
        # u * total may round up to total; stay strictly below it so the search lands on a real token.
        target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
        picked = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=x.shape[1] - 1)
        if index is None:
            return picked
        return x.argmax(dim=-1).index_copy_(0, index, picked)

    def _weights(self, x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Unnormalised probabilities (0 = filtered out) of non-greedy rows after temperature, top_k, top_p, min_p."""
        n = x.shape[1]
        ks = [p.top_k if 0 < p.top_k < n else 0 for p in params]
        q = torch.tensor(
            [[p.temperature, k, p.top_p, p.min_p] for p, k in zip(params, ks)], dtype=torch.float32, device=x.device
        )
        temperature, top_k, top_p, min_p = (c.unsqueeze(1) for c in q.unbind(1))
        l = x / temperature
        k_rows = [i for i, k in enumerate(ks) if k]
        p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
        dropped = None
        if k_rows or p_rows:  # temperature-only and min_p-only rows never reach a sort or a topk
            dropped = l < cuts(l, ks, top_k, top_p, k_rows, p_rows)
        # exp(l - max) is each token's probability relative to the largest, which is what min_p compares.
        # No cut reaches a row's largest logit, so its max is the same before and after the cuts. Cut
        # tokens go through exp as 0 and come out as 0: the same bits as exp(-inf), without exp's slow
        # path for -inf.
        weights = l.sub_(l.amax(dim=-1, keepdim=True))
        if dropped is not None:
            weights.masked_fill_(dropped, 0.0)
        weights.exp_()
        if dropped is not None:
            weights.masked_fill_(dropped, 0.0)
        if any(p.min_p > 0.0 for p in params):
            weights.masked_fill_(weights < min_p, 0.0)
        return weights
