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
  generated) -> greedy rows take the argmax of the penalised logits ->
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
* One bad row never takes the batch down: `sample` returns `int |
  SamplingError` per row, the error for a row whose logits contain NaN or
  +inf or are all -inf.

How it stays cheap: greedy, temperature-only and min_p-only rows never sort
(min_p compares with the largest probability, a max); top_k takes a `topk`.
top_p needs the sorted distribution, and a full-vocabulary sort costs more
than a decode step on a CPU, so there a top_p row sorts only candidates, a
prefix of its sort that is sure to hold the cut, and the whole row only when
no such prefix is found cheaply (flat distributions, ties running past the
candidates). The candidate path gives the full sort's cut bit for bit; it
reads tensors back to choose (free on the CPU). Off the CPU every row with a
cut sorts whole, so the single sync stays the only one. The sorted masses
are the softmax of the sorted, top_k-cut row, except for top_p rows without
a top_k on the CPU: theirs are the softmax of the unsorted row, which a
prefix can reproduce; the two differ only in how the softmax's sum rounds,
which moves a cut only where a preceding mass lies within float32 rounding
of top_p.

Seam for grammars and reasoning budgets (out of scope here, spec 3.10): their
vocab masks would apply right after the penalties, and a row masked to
nothing becomes a further per-row outcome (`GrammarComplete`) next to
`SamplingError`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferrox_batch.errors import DecodeError, TokenOutOfVocab
from ferrox_batch.generate import SamplingParams

__all__ = ["MIN_TEMPERATURE", "BatchSampler", "RowSampler", "SamplingError"]

#: Below this a temperature is treated as greedy.
MIN_TEMPERATURE = 1e-5
_MAX_SEED = 2**64 - 1
#: A CPU top_p row without a top_k sorts as candidates the logits whose
#: probability buckets (`_BUCKETS` of them, by float bits) reach top_p +
#: `_MASS_MARGIN` of the mass, widened by `_LOGIT_MARGIN` nats. Candidates
#: beyond `_CANDIDATE_SHARE` of the vocabulary are not worth it; 0 sends every
#: top_p row to the full sort (the tests compare the two paths).
_BUCKETS = 1024
_MASS_MARGIN = 1e-4
_LOGIT_MARGIN = 1e-3
_CANDIDATE_SHARE = 0.5
# Row status codes carried through the single host sync (index 0 = fine).
_PROBLEMS = (
    "",
    "the model's logits contain NaN",
    "the model's logits contain +inf",
    "every logit is -inf, so no token can be sampled",
)


class SamplingError(DecodeError):
    """A row's logits could not be sampled; `row` is its index in the batch handed to `sample`."""

    http_status = 500
    error_code = "sampling_error"
    _fields = ("row", "detail")

    def __init__(self, row: int, detail: str) -> None:
        self.row = row
        self.detail = detail
        super().__init__(f"sampling failed: {detail}")


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

    @property
    def greedy(self) -> bool:
        return self.generator is None

    def record(self, token: int) -> None:
        """Count `token` into the penalty window (`sample` does this for the tokens it returns)."""
        if self.counts is not None:
            if not 0 <= token < self.counts.shape[0]:
                raise ValueError(f"token {token} is outside the vocabulary of {self.counts.shape[0]}")
            self.counts[token] += 1


def _penalised(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


class BatchSampler:
    """Samples one token per row from a batch of logits; holds no per-request state itself."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)

    def new_row(self, params: SamplingParams, seed: int | None, prompt_ids: Sequence[int]) -> RowSampler:
        """The state for one admitted request; `prompt_ids` opens its penalty window."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {params!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED):
            raise ValueError(f"seed must be None or an integer in [0, 2**64 - 1], got {seed!r}")
        generator = None
        if params.temperature >= MIN_TEMPERATURE:
            if seed is None:
                seed = int.from_bytes(os.urandom(8), "little")
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
        else:
            seed = None
        counts = None
        if _penalised(params):
            ids = list(prompt_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise TokenOutOfVocab(bad[0], self.vocab_size)
            counts = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
            if ids:
                # index_add_, not bincount: bincount on CUDA syncs to size its output.
                index = torch.tensor(ids, dtype=torch.long, device=self.device)
                counts.index_add_(0, index, torch.ones(len(ids), dtype=torch.float32, device=self.device))
        return RowSampler(params, generator, counts, seed)

    def sample(self, logits: torch.Tensor, rows: Sequence[RowSampler]) -> list[int | SamplingError]:
        """One token id per row, or a `SamplingError` for a row that cannot be sampled.

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
        tokens = self._choose(self._penalise(x, rows), rows)
        out: list[int | SamplingError] = []
        for i, (token, row) in enumerate(zip(torch.where(status == 0, tokens, -status).tolist(), rows)):
            if token < 0:
                out.append(SamplingError(i, _PROBLEMS[-token]))
            else:
                row.record(token)
                out.append(token)
        return out

    def distribution(self, logits: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
        """The `[B, vocab_size]` distribution `sample` would draw from (one-hot for greedy rows).

        Draws nothing and records nothing; for tests and log-probabilities.
        """
        x = self._penalise(self._checked(logits, rows), rows)
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

    def _penalise(self, x: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
        pen = [i for i, row in enumerate(rows) if row.counts is not None]
        if not pen:
            return x
        counts = torch.stack([rows[i].counts for i in pen])  # type: ignore[misc]
        q = torch.tensor(
            [[p.repetition_penalty, p.presence_penalty, p.frequency_penalty] for p in (rows[i].params for i in pen)],
            dtype=torch.float32, device=x.device,
        )
        rep, presence, frequency = (c.unsqueeze(1) for c in q.unbind(1))
        every = len(pen) == len(rows)
        index = None if every else torch.tensor(pen, device=x.device)
        l = x if index is None else x.index_select(0, index)
        seen = counts > 0
        # Each penalty is one or two full passes over [rows, vocab]: skip the ones no row uses.
        if any(rows[i].params.repetition_penalty != 1.0 for i in pen):
            l = torch.where(seen, torch.where(l > 0, l / rep, l * rep), l)
        if any(rows[i].params.frequency_penalty != 0.0 for i in pen):
            l = l - frequency * counts
        if any(rows[i].params.presence_penalty != 0.0 for i in pen):
            l = l - presence * seen
        # Out of place: `x` may be a view of the caller's logits.
        return l if index is None else x.index_copy(0, index, l)

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
            dropped = l < _cuts(l, ks, top_k, top_p, k_rows, p_rows)
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


def _index(rows: Sequence[int], total: int, device: torch.device) -> torch.Tensor | None:
    """An index tensor for `rows`, or None when they are all `total` rows in order."""
    return None if len(rows) == total else torch.tensor(rows, dtype=torch.long, device=device)


def _pick(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return t if index is None else t.index_select(0, index)


def _put(into: torch.Tensor, index: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    return rows if index is None else into.index_copy_(0, index, rows)


def _cuts(
    l: torch.Tensor, ks: Sequence[int], top_k: torch.Tensor, top_p: torch.Tensor,
    k_rows: Sequence[int], p_rows: Sequence[int],
) -> torch.Tensor:
    """Each row's `[B, 1]` cut: tokens below it are dropped (-inf: no cut).

    top_k's cut is the k-th largest logit; top_p's is the logit of the last
    token of the shortest sorted prefix whose preceding mass stays < top_p.
    Off the CPU every row with a cut sorts its whole row, reading nothing
    back. On the CPU a row sorts only candidates (a prefix of its sort) when
    they are sure to give the full sort's cut bit for bit, and its whole row
    otherwise (see `_nucleus_from_top_k` and `_nucleus_without_top_k`).
    """
    b, n = l.shape
    dev = l.device
    cut = torch.full_like(top_p, float("-inf"))
    if p_rows and not _reads_back(dev):
        # One sort of every row with a cut and no host read: the batch keeps its single sync.
        index = _index(sorted({*k_rows, *p_rows}), b, dev)
        ordered = torch.sort(_pick(l, index), dim=-1, descending=True).values
        kc, pc = _pick(top_k, index), _pick(top_p, index)
        kth = torch.where(kc > 0, ordered.gather(1, (kc.long() - 1).clamp_(min=0)), float("-inf"))
        last, _ = _sorted_nucleus(ordered, kth, pc)
        return _put(cut, index, torch.where(pc < 1.0, torch.maximum(kth, last), kth))
    with_k = [i for i in p_rows if ks[i]]
    if k_rows:
        index = _index(k_rows, b, dev)
        # Enough for every row's k-th value; a top_p row's also wants to see where its ties end, and at
        # least 16 logits (see _nucleus_from_top_k).
        width = min(n, max(max(ks) + 1, 16)) if with_k else max(ks)
        head = torch.topk(_pick(l, index), width, dim=-1).values
        cut = _put(cut, index, head.gather(1, (_pick(top_k, index).long() - 1).clamp_(min=0)))
        if with_k:
            place = {row: i for i, row in enumerate(k_rows)}
            index = _index(with_k, b, dev)
            head = _pick(head, _index([place[i] for i in with_k], len(k_rows), dev))
            cut = _put(cut, index, _nucleus_from_top_k(l, index, head, _pick(cut, index), _pick(top_p, index)))
    without_k = [i for i in p_rows if not ks[i]]
    if without_k:
        index = _index(without_k, b, dev)
        cut = _put(cut, index, _nucleus_without_top_k(_pick(l, index), _pick(top_p, index)))
    return cut


def _reads_back(device: torch.device) -> bool:
    """Whether the cuts may read tensors back to choose a path: free on the CPU, a sync anywhere else."""
    return device.type == "cpu"


def _nucleus(sorted_probs: torch.Tensor, ordered: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """top_p's cut over a sorted prefix of each row, and the running sum's last value (the prefix's mass).

    `sorted_probs[i, j]` is the probability of the token whose logit is
    `ordered[i, j]` (0 past the end of a row's prefix). Rows with top_p = 1
    get some logit of theirs: callers keep only the rows with top_p < 1.
    """
    running = sorted_probs.cumsum(dim=-1)
    before = running - sorted_probs  # mass strictly ahead of each sorted token
    keep = (before < top_p).sum(dim=-1, keepdim=True)  # >= 1 (before[0] is exactly 0) unless the row is NaN
    last = ordered.gather(1, (keep - 1).clamp_(min=0))
    return torch.where(top_p < 1.0, last, float("-inf")), running[:, -1:]


def _sorted_nucleus(ordered: torch.Tensor, kth: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_nucleus` with the probabilities as the softmax of the sorted, top_k-cut row."""
    return _nucleus(torch.softmax(ordered.masked_fill(ordered < kth, float("-inf")), dim=-1), ordered, top_p)


def _holds(mass: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Whether a sorted prefix whose running sum ends at `mass` is sure to hold top_p's cut.

    Every later token of the full sort sees a preceding mass within 2**-23
    of that sum (the running sum is accumulated in float64 and rounded to
    float32 per element), so from top_p + 2**-22 on none of them is kept.
    """
    return (mass.double() >= top_p.double() + 2.0**-22) | (top_p >= 1.0)


def _nucleus_from_top_k(
    l: torch.Tensor, index: torch.Tensor | None, head: torch.Tensor, kth: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The cut of rows `index` of `l` that have both top_k and top_p, from `head`, their largest logits sorted.

    The probabilities are the softmax of the sorted, top_k-cut row, whose
    tokens past the top_k cut weigh exactly 0. Over a head of >= 16 logits
    that holds every nonzero one, the CPU softmax sums the same bits as over
    the whole sorted row (its vector lanes only ever add those zeros; the
    tests check this), so the head gives the full sort's cut. Rows whose
    top_k ties may run on past the head, or whose head misses top_p's cut
    (`_holds`), sort whole.
    """
    n = l.shape[1]
    last, mass = _sorted_nucleus(head, kth, top_p)
    cut = torch.maximum(kth, last)
    if head.shape[1] == n:
        return cut
    held = _holds(mass, top_p) & (head[:, -1:] < kth)
    whole = [i for i, ok in enumerate(held.squeeze(1).tolist()) if not ok or _CANDIDATE_SHARE <= 0]
    if whole:
        at = _index(whole, head.shape[0], l.device)
        rows = at if index is None else _pick(index, at)
        ordered = torch.sort(_pick(l, rows), dim=-1, descending=True).values
        kth_whole, top_p_whole = _pick(kth, at), _pick(top_p, at)
        last, _ = _sorted_nucleus(ordered, kth_whole, top_p_whole)
        cut = _put(cut, at, torch.maximum(kth_whole, last))
    return cut


def _nucleus_without_top_k(l: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The cut of top_p rows without a top_k on the CPU, sorting only their candidates where they hold it.

    The probabilities are the softmax of the unsorted row gathered into
    sorted order, which any sorted prefix of the row can reproduce (the
    sorted row's softmax could not: its sum runs over the whole sort). A
    row's candidates are every logit in the histogram buckets of its
    probabilities that first reach top_p + `_MASS_MARGIN`, counted down from
    the top: every logit >= their smallest, ties included, so a prefix of the
    row's sort with the same probabilities and running sum as there. Rows
    whose candidates miss the cut (`_holds`), or are too many to be worth it
    (`_few_enough`), sort whole. Deciding reads back from the tensors, which
    on the CPU costs no sync.
    """
    f, n = l.shape
    dev = l.device
    probs = torch.softmax(l, dim=-1)
    cut = torch.full_like(top_p, float("-inf"))
    full = list(range(f))
    if _CANDIDATE_SHARE > 0:
        # Bucket each probability by its float bits: exponent and top 3 mantissa bits, 8 buckets an
        # octave (a NaN, from a bad row, lands in the first or last). Counted down from the top, the
        # buckets that reach the aim give a probability floor, and the candidates are the logits at or
        # above the floor's logit less a margin: value-closed, whatever the rounding of exp.
        bucket = (probs.view(torch.int32) >> 20).clamp_(0, _BUCKETS - 1)
        bucket += torch.arange(0, f * _BUCKETS, _BUCKETS, dtype=torch.int32, device=dev).unsqueeze(1)
        # index_add_, not scatter_add_: it takes int32 indices on every supported torch, without a copy.
        mass = torch.zeros(f * _BUCKETS, dtype=probs.dtype, device=dev).index_add_(0, bucket.view(-1), probs.view(-1))
        short = (mass.view(f, _BUCKETS).flip(-1).cumsum(dim=-1) < top_p + _MASS_MARGIN).sum(dim=-1, keepdim=True)
        floor = ((_BUCKETS - 1 - short).clamp_(min=0).to(torch.int32) << 20).view(torch.float32)
        at_least = l.amax(dim=-1, keepdim=True) + (floor / probs.amax(dim=-1, keepdim=True)).log_() - _LOGIT_MARGIN
        at_least.masked_fill_(floor == 0, float("inf"))  # no floor: the whole row, so no candidates at all
        row, col = (l >= at_least).nonzero().unbind(1)  # grouped by row
        counts = torch.bincount(row, minlength=f)
        few = _few_enough(counts.tolist(), n)
        chosen = set(few)
        full = [i for i in range(f) if i not in chosen]
        if few:
            index = _index(few, f, dev)
            if index is not None:  # drop the other rows' candidates, number the rest by their place in `few`
                slot = torch.full((f,), -1, dtype=torch.long, device=dev)
                slot[index] = torch.arange(len(few), device=dev)
                kept = slot[row] >= 0
                row, col = row[kept], col[kept]
            count = _pick(counts, index)
            place = row if index is None else slot[row]
            pos = torch.arange(row.shape[0], device=dev) - (count.cumsum(0) - count)[place]
            width = int(count.max())
            values = torch.full((len(few), width), float("-inf"), device=dev)
            values[place, pos] = l[row, col]
            unsorted = torch.zeros((len(few), width), dtype=probs.dtype, device=dev)
            unsorted[place, pos] = probs[row, col]
            ordered, order = torch.sort(values, dim=-1, descending=True)
            top_p_few = _pick(top_p, index)
            few_cut, few_mass = _nucleus(unsorted.gather(1, order), ordered, top_p_few)
            cut = _put(cut, index, few_cut)
            full += [i for i, ok in zip(few, _holds(few_mass, top_p_few).squeeze(1).tolist()) if not ok]
    if full:
        index = _index(sorted(full), f, dev)
        ordered, order = torch.sort(_pick(l, index), dim=-1, descending=True)
        full_cut, _ = _nucleus(_pick(probs, index).gather(1, order), ordered, _pick(top_p, index))
        cut = _put(cut, index, full_cut)
    return cut


def _few_enough(counts: Sequence[int], n: int) -> list[int]:
    """The rows that sort only their candidates, padded to the longest of them; the rest sort whole.

    Picks the width that sorts the fewest elements in all (sorting a whole
    row costs about as much as sorting `n` padded candidates), never above
    `_CANDIDATE_SHARE` of the vocabulary.
    """
    widths = sorted(c for c in counts if 0 < c <= _CANDIDATE_SHARE * n)
    if not widths:
        return []
    rows = len(counts)
    # Padding to widths[j] sorts at least j + 1 rows that way (exactly, at the last of equal widths).
    best = min(range(len(widths)), key=lambda j: ((j + 1) * widths[j] + (rows - j - 1) * n, j))
    return [i for i, c in enumerate(counts) if 0 < c <= widths[best]]
