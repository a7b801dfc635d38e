"""The mixture-of-experts router (`router.route`) against a plain per-row reference in float64.

For every kind of router a family can ask for (softmax or sigmoid scores, a correction bias that steers
the choice alone, experts chosen group by group, renormalised or not, scaled) each row's k experts must be
the reference's, compared as sets, and each one's weight the reference's within what float32's roundings
allow (derived below). Logits are drawn so the choice is decided by the arithmetic: a permutation of
well-separated values plus noise, and an example whose decision lies within float32's reach of a tie is
discarded. A row's result must not depend on the rows beside it, bit for bit; the outputs' dtypes and
shapes are the promised ones; and `RouterSpec` refuses exactly the routers that cannot choose k experts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numerics import TORCH_SOFTMAX_EXP_ULPS, gamma, softmax_error, unit_roundoff

from ferrox_batch.runtime.architectures.router import route
from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.moe_spec import RouterSpec

U = unit_roundoff(torch.float32)
#: How far apart (relative to the magnitudes that make them) two values the choice compares must lie for
#: float32 to order them as float64 does: every score is within about 150 u of its exact value (the
#: softmax's bound at 64 experts and logits 40 apart, below), far below this.
DECISIVE = 1e-4


@st.composite
def routers(draw: st.DrawFn, max_experts: int = 16) -> RouterSpec:
    """A router `RouterSpec` accepts: groups dividing the experts, k within the chosen groups."""
    groups = draw(st.sampled_from([1, 1, 2, 3, 4]))
    per_group = draw(st.integers(1, max(1, max_experts // groups)))
    topk_groups = draw(st.integers(1, groups))
    bias = draw(st.booleans())
    return RouterSpec(experts=groups * per_group, top_k=draw(st.integers(1, topk_groups * per_group)),
                      scoring=draw(st.sampled_from(["softmax", "sigmoid"])), renormalize=draw(st.booleans()),
                      correction_bias="e_score_correction_bias" if bias else None, groups=groups,
                      topk_groups=topk_groups, scale=draw(st.sampled_from([1.0, 2.5, 0.375])))


def draw_logits(rng: np.random.Generator, rows: int, experts: int, spacing: float, scoring: str) -> np.ndarray:
    """Each row a permutation of values `spacing` apart, each moved by under a tenth of that, within +-20
    (softmax) or +-6 (sigmoid: past that, float32's sigmoids of different logits meet at 1)."""
    spacing = min(spacing, (40.0 if scoring == "softmax" else 12.0) / experts)
    out = [spacing * (rng.permutation(experts) - experts / 2 + rng.uniform(-0.1, 0.1, experts)) for _ in range(rows)]
    return np.asarray(out, dtype=np.float32).reshape(rows, experts)


def reference(logits: np.ndarray, spec: RouterSpec, bias: np.ndarray | None) -> tuple[list[int], np.ndarray, bool]:
    """One row in float64, as the router's docstring says: `(ids, weights, decisive)`, `decisive` where every
    comparison the choice makes is wider than float32 can blur (`DECISIVE`)."""
    l = logits.astype(np.float64)
    if spec.scoring == "softmax":
        e = np.exp(l - l.max())
        scores = e / e.sum()
    else:
        scores = 1 / (1 + np.exp(-l))
    b = np.zeros_like(scores) if bias is None else bias.astype(np.float64)
    choice, size = scores + b, np.abs(scores) + np.abs(b)  # each value, and what its roundings scale with
    pairs: list[tuple[float, float, float]] = []  # (must be larger, than this, magnitudes)
    if spec.groups > 1:
        per = spec.experts // spec.groups
        grouped, sizes = choice.reshape(spec.groups, per), size.reshape(spec.groups, per)
        if bias is not None and per >= 2:
            top2 = np.sort(grouped, axis=1)[:, -2:]
            rank, rank_size = top2.sum(1), np.sort(sizes, axis=1)[:, -2:].sum(1) + np.abs(top2).sum(1)
        else:
            rank, rank_size = grouped.max(1), sizes.max(1)
        order = np.argsort(-rank, kind="stable")
        if spec.topk_groups < spec.groups:
            a, c = order[spec.topk_groups - 1], order[spec.topk_groups]
            pairs.append((rank[a], rank[c], rank_size[a] + rank_size[c]))
        keep = np.zeros(spec.groups, dtype=bool)
        keep[order[:spec.topk_groups]] = True
        choice = np.where(np.repeat(keep, per), choice, -np.inf)
    order = np.argsort(-choice, kind="stable")
    ids = order[:spec.top_k]
    if spec.top_k < spec.experts and np.isfinite(choice[order[spec.top_k]]):
        a, c = order[spec.top_k - 1], order[spec.top_k]
        pairs.append((choice[a], choice[c], size[a] + size[c]))
    # Within the chosen experts, the order is irrelevant (compared as sets); across them, decisive.
    decisive = all(a - c > DECISIVE * m for a, c, m in pairs)
    weights = scores[ids]
    if spec.renormalize:
        weights = weights / weights.sum()
    return ids.tolist(), weights * spec.scale, decisive


def weight_bound(logits: np.ndarray, spec: RouterSpec, ids: list[int], want: np.ndarray) -> np.ndarray:
    """How far float32's weights may be from the exact ones.

    Each score first: softmax within `softmax_error` (its exp, the max's subtraction, the sum and the
    division each rounding; torch's softmax exp within its documented 20 ulps); sigmoid is the router's
    softmax of (l, 0), so within that pair's `softmax_error`. Gathering is exact. Renormalising sums k
    scores (gamma_k of their sum, all positive) and divides once (u): p~_i / S~ is within
    (a_i + w_i |S~ - S|) / (S - |S~ - S|) of p_i / S. The scale multiplies once more (u)."""
    l = torch.from_numpy(logits).double()
    if spec.scoring == "softmax":
        scores = torch.softmax(l, -1)
        error = softmax_error(scores, exp_ulps=TORCH_SOFTMAX_EXP_ULPS).numpy()
    else:
        scores = torch.sigmoid(l)
        error = softmax_error(torch.stack((scores, 1 - scores), -1), exp_ulps=TORCH_SOFTMAX_EXP_ULPS)[..., 0].numpy()
    p, a = scores.numpy()[ids], error[ids]
    if spec.renormalize and spec.top_k == 1:
        a = np.zeros_like(a)  # x / x is exactly 1 for any finite nonzero x
    elif spec.renormalize:
        s = p.sum()
        drift = a.sum() + gamma(spec.top_k) * (s + a.sum())
        w = p / s
        # Scores so small that their sum's error may reach the sum itself bound nothing.
        a = (a + w * drift) / (s - drift) if s > drift else np.full_like(a, np.inf)
        a = a + U * (w + a)
    scale = abs(spec.scale)
    return scale * a + (0.0 if spec.scale == 1.0 else U * (np.abs(want) + scale * a))


@settings(max_examples=150)
@given(spec=routers(), rows=st.integers(1, 6), seed=st.integers(0, 2**32 - 1),
       spacing=st.sampled_from([0.05, 0.3, 1.0, 2.5]), bias_scale=st.sampled_from([0.01, 0.2, 1.0]))
def test_each_row_routes_as_the_float64_reference(spec: RouterSpec, rows: int, seed: int, spacing: float,
                                                  bias_scale: float) -> None:
    rng = np.random.default_rng(seed)
    logits = draw_logits(rng, rows, spec.experts, spacing, spec.scoring)
    bias = None if spec.correction_bias is None else (rng.normal(0, bias_scale, spec.experts)).astype(np.float32)
    refs = [reference(row, spec, bias) for row in logits]
    assume(all(decisive for _, _, decisive in refs))
    weights, ids = route(torch.from_numpy(logits), spec, None if bias is None else torch.from_numpy(bias))
    for r, (want_ids, want, _) in enumerate(refs):
        got = dict(zip(ids[r].tolist(), weights[r].double().tolist(), strict=True))
        assert sorted(got) == sorted(want_ids), f"row {r}: experts {sorted(got)}, want {sorted(want_ids)}"
        bound = weight_bound(logits[r], spec, want_ids, want)
        error = np.abs(np.array([got[i] for i in want_ids]) - want)
        assert (error <= bound).all(), f"row {r}: weights {error} off, bounds {bound}"


def test_the_correction_bias_steers_the_choice_and_not_the_weights() -> None:
    """Sigmoid scores 0.9 > 0.6 > 0.3; a bias turning the order around picks the two low ones, weighted by
    their own scores (renormalised over the two, as DeepSeek-style routers do)."""
    logits = torch.logit(torch.tensor([[0.9, 0.6, 0.3]], dtype=torch.float64)).float()
    spec = RouterSpec(experts=3, top_k=2, scoring="sigmoid", renormalize=True, correction_bias="b")
    weights, ids = route(logits, spec, torch.tensor([-1.0, 0.0, 0.5]))
    assert sorted(ids[0].tolist()) == [1, 2]
    got = dict(zip(ids[0].tolist(), weights[0].tolist(), strict=True))
    assert math.isclose(got[1], 0.6 / 0.9, rel_tol=1e-6) and math.isclose(got[2], 0.3 / 0.9, rel_tol=1e-6)


def test_groups_are_ranked_by_their_two_best_biased_scores_with_a_bias_and_their_best_without() -> None:
    """Group 0 holds the single best score, group 1 the best pair: the bias's rule picks group 1, the
    plain rule group 0."""
    scores = torch.tensor([[0.95, 0.05, 0.7, 0.68]], dtype=torch.float64)
    logits = torch.logit(scores).float()
    with_bias = RouterSpec(experts=4, top_k=1, scoring="sigmoid", correction_bias="b", groups=2, topk_groups=1)
    _, ids = route(logits, with_bias, torch.zeros(4))
    assert ids.tolist() == [[2]]
    plain = RouterSpec(experts=4, top_k=1, scoring="sigmoid", groups=2, topk_groups=1)
    _, ids = route(logits, plain)
    assert ids.tolist() == [[0]]


@settings(max_examples=40)
@given(spec=routers(max_experts=64), rows=st.integers(2, 40), seed=st.integers(0, 2**32 - 1),
       ties=st.booleans())
def test_a_row_routes_the_same_alone_as_in_any_batch(spec: RouterSpec, rows: int, seed: int, ties: bool) -> None:
    """Bit for bit, ids and weights; `ties` draws logits from four values, so the tie-breaking must not
    depend on the batch either."""
    gen = torch.Generator().manual_seed(seed)
    if ties:
        logits = torch.tensor([-1.0, 0.0, 0.5, 2.0])[torch.randint(0, 4, (rows, spec.experts), generator=gen)]
    else:
        logits = torch.randn(rows, spec.experts, generator=gen) * 3
    bias = None if spec.correction_bias is None else torch.randn(spec.experts, generator=gen) * 0.1
    weights, ids = route(logits, spec, bias)
    for r in range(rows):
        alone_w, alone_ids = route(logits[r:r + 1].clone(), spec, bias)
        assert torch.equal(alone_ids[0], ids[r]) and torch.equal(alone_w[0], weights[r]), f"row {r}"
    cut = rows // 2
    part_w, part_ids = route(logits[cut:].clone(), spec, bias)
    assert torch.equal(part_ids, ids[cut:]) and torch.equal(part_w, weights[cut:])


@pytest.mark.parametrize("rows", [0, 1, 7])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_outputs_are_float32_weights_and_int64_ids_of_rows_by_k(rows: int, scoring: str) -> None:
    spec = RouterSpec(experts=8, top_k=3, scoring=scoring, correction_bias="b", groups=4, topk_groups=2)
    weights, ids = route(torch.randn(rows, 8), spec, torch.zeros(8))
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (rows, 3)
    if rows:
        assert bool((ids >= 0).all() and (ids < 8).all())
        assert all(len(set(row)) == 3 for row in ids.tolist())  # k distinct experts per row


@pytest.mark.parametrize(("fields", "message"), [
    ({"experts": 0, "top_k": 1}, "needs experts"),
    ({"experts": 4, "top_k": 5}, "num_experts_per_tok is 5"),
    ({"experts": 4, "top_k": 0}, "num_experts_per_tok is 0"),
    ({"experts": 8, "top_k": 2, "scoring": "relu"}, "scoring 'relu'"),
    ({"experts": 8, "top_k": 2, "groups": 3}, "n_group 3 does not divide"),
    ({"experts": 8, "top_k": 2, "groups": 0}, "n_group 0"),
    ({"experts": 8, "top_k": 2, "groups": 4, "topk_groups": 5}, "topk_group 5"),
    ({"experts": 8, "top_k": 2, "groups": 4, "topk_groups": 0}, "topk_group 0"),
    ({"experts": 8, "top_k": 5, "groups": 4, "topk_groups": 2}, "more than the 2 chosen groups hold"),
])
def test_a_router_that_cannot_choose_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        RouterSpec(**fields)


@settings(max_examples=200)
@given(experts=st.integers(-1, 12), top_k=st.integers(-1, 13), groups=st.integers(-1, 7),
       topk_groups=st.integers(-1, 8))
def test_a_router_is_refused_exactly_when_its_choice_is_impossible(experts: int, top_k: int, groups: int,
                                                                   topk_groups: int) -> None:
    possible = (experts > 0 and 0 < top_k <= experts and groups > 0 and experts % groups == 0
                and 0 < topk_groups <= groups and top_k <= topk_groups * (experts // groups))
    try:
        RouterSpec(experts=experts, top_k=top_k, groups=groups, topk_groups=topk_groups)
    except ModelLoadError:
        assert not possible
    else:
        assert possible
