"""The mixture-of-experts router: which k experts each row goes to, and each one's weight.

One vectorised pass over the rows' float32 logits (no loop over rows or experts): softmax or sigmoid
scores; a correction bias added to the scores for the choice alone; where the experts are grouped, every
expert outside the best `topk_groups` groups masked out (a group ranked by the sum of its two best biased
scores where there is a correction bias, else by its best score); the top k; their scores (never the
biased ones) renormalised over the k where the family does it, then scaled (by one factor, and by each
chosen expert's own where the family has them).

Promises: the weights are float32, the ids int64, both `[rows, k]`; a row's result depends on that row's
logits alone.
"""

from __future__ import annotations

import torch

from ferrox_batch.runtime.families.moe_spec import RouterSpec


def route(logits: torch.Tensor, spec: RouterSpec, correction: torch.Tensor | None = None,
          expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights, ids)` for `[rows, experts]` float32 `logits` (module docstring); `correction` is the
    `[experts]` bias the spec's `correction_bias` names, `expert_scale` the `[experts]` float32 factors its
    `expert_scale` names (each chosen weight times its expert's)."""
    if spec.scoring == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        # sigmoid(l) as the softmax of (l, 0): torch's elementwise sigmoid runs a flat tensor's elements in
        # vectors and its tail apart, which round differently, so a row's scores would move with the rows
        # before it; the softmax runs each row (here each pair) alike.
        scores = torch.stack((logits, torch.zeros_like(logits)), dim=-1).softmax(dim=-1)[..., 0]
    choice = scores if correction is None else scores + correction
    if spec.groups > 1:
        rows = choice.shape[0]
        grouped = choice.view(rows, spec.groups, spec.experts // spec.groups)
        if correction is not None and grouped.shape[-1] >= 2:
            rank = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            rank = grouped.amax(dim=-1)
        best = rank.topk(spec.topk_groups, dim=-1).indices
        keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(rows, spec.experts)
    ids = choice.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.scale != 1.0:
        weights = weights * spec.scale
    if expert_scale is not None:
        weights = weights * expert_scale[ids]
    return weights, ids
