"""The per-row logit transforms of a sampling call, each one vectorised over the rows that use it.

In the order `BatchSampler.sample` applies them: penalties (repetition, frequency, presence, over each
row's window), the bias vector (`logit_bias`, `allowed_token_ids`, one-token bad words), the bans that
depend on what a row generated (`min_tokens`' stop ids, the ends of longer bad words), grammar masks. (The log-probabilities of the raw logits, for the rows that
ask, are `logprobs`.) Each touches only the rows that need it (one `index_select`/`index_copy`),
works out of place (the input may be a view of the caller's logits), and skips the passes no row uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ferrox_batch.runtime.sampling.sampler_rows import RowSampler


def penalised(x: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
    """Repetition, frequency and presence penalties applied to the rows that have a window."""
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


def biased(x: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
    """`logit_bias` added to the rows that have one, in one op (out of place, as the penalties)."""
    with_bias = [i for i, row in enumerate(rows) if row.bias is not None]
    if not with_bias:
        return x
    bias = torch.stack([rows[i].bias for i in with_bias])  # type: ignore[misc]
    if len(with_bias) == len(rows):
        return x + bias
    return x.index_add(0, torch.tensor(with_bias, device=x.device), bias)


def masked(x: torch.Tensor, masks: tuple[list[int], torch.Tensor] | None) -> torch.Tensor:
    """Tokens outside a constrained row's grammar set to -inf (out of place); other rows untouched."""
    if masks is None:
        return x
    index, allowed = masks
    rows = torch.tensor(index, device=x.device)
    return x.index_copy(0, rows, x.index_select(0, rows).masked_fill(~allowed, float("-inf")))


def banned(x: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
    """Each row's `banned_now` ids set to -inf, in one write (out of place); rows with none untouched."""
    pairs = [(i, t) for i, row in enumerate(rows) if row.hold_left > 0 or row.sequences for t in row.banned_now()]
    if not pairs:
        return x
    index = torch.tensor(pairs, device=x.device).t()
    return x.index_put((index[0], index[1]), torch.tensor(float("-inf"), device=x.device))
