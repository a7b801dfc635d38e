"""The batched sampler: greedy and filters against references, seeding, penalties, per-row errors."""

from __future__ import annotations

import math
import pickle
import random

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numerics import TORCH_EXP_ULPS, TORCH_SOFTMAX_EXP_ULPS, gamma, softmax_error, unit_roundoff

from ferrox_batch.errors import DecodeError, TokenOutOfVocab
from ferrox_batch.generation_types import FLOAT32_TINY, SamplingParams
from ferrox_batch.runtime.sampling import sampling_cuts as cuts_module
from ferrox_batch.runtime.sampling.sampler import BatchSampler, RowSampler, SamplingError

GREEDY = SamplingParams()
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.2}


def randn(*shape: int, seed: int, device: str, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device)


def reference_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, float64, written as the definitions read (ties at a cut are kept: filters cut by value)."""
    l = (logits.float() / torch.tensor(p.temperature, dtype=torch.float32)).double().cpu()
    keep = torch.ones_like(l, dtype=torch.bool)
    if 0 < p.top_k < len(l):
        keep &= l >= torch.sort(l, descending=True).values[p.top_k - 1]
    if p.top_p < 1.0:
        probs = torch.softmax(l.masked_fill(~keep, -math.inf), 0)
        ordered = torch.sort(probs, descending=True).values
        kept, before = [], 0.0
        for q in ordered.tolist():
            if before >= p.top_p:
                break
            kept.append(q)
            before += q
        keep &= probs >= kept[-1]
    probs = torch.softmax(l.masked_fill(~keep, -math.inf), 0)
    keep &= probs >= p.min_p * probs.max()
    return torch.softmax(l.masked_fill(~keep, -math.inf), 0)


def far_from_cuts(logits: torch.Tensor, p: SamplingParams) -> bool:
    """False when float32 vs float64 rounding could move a top_p or min_p cut (hypothesis skips those).

    top_k compares the same float32 logits on both sides. top_p compares a float32 running sum of
    float32 probabilities (each within `softmax_error` of its exact value; the sum adds gamma_n) with
    the same float32 top_p. min_p compares exp(l - max) (relative error u * (max - l) from the
    subtraction and exp's ulps) with min_p rounded to float32 (u * min_p), where the reference keeps it
    exact.
    """
    u = unit_roundoff(torch.float32)
    l = (logits.float() / p.temperature).double().cpu()
    if 0 < p.top_k < len(l):
        l = l.masked_fill(l < torch.sort(l, descending=True).values[p.top_k - 1], -math.inf)
    probs = torch.sort(torch.softmax(l, 0), descending=True).values
    before = torch.cumsum(probs, 0) - probs
    top_p_margin = float(softmax_error(probs, exp_ulps=TORCH_EXP_ULPS).sum()) + gamma(len(l))
    ok = p.top_p == 1.0 or bool(((before - torch.tensor(p.top_p, dtype=torch.float32).double()).abs() > top_p_margin).all())
    ratio = probs / probs[0]
    below_max = -ratio.log().nan_to_num(posinf=0.0)  # max - l, for the tokens still in
    min_p_margin = ratio * (u * below_max + 2 * TORCH_EXP_ULPS * u) + u * p.min_p
    return ok and (p.min_p == 0.0 or bool(((ratio - p.min_p).abs() > min_p_margin).all()))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), b=st.integers(1, 6), vocab=st.integers(1, 50), pad=st.integers(0, 7))
def test_greedy_is_argmax_and_never_picks_padding(device, seed, b, vocab, pad):
    logits = randn(b, vocab + pad, seed=seed, device=device)
    logits[:, vocab:] = 1e9  # a padded lm head's columns must be invisible
    sampler = BatchSampler(vocab, device)
    rows = [sampler.new_row(GREEDY, None, []) for _ in range(b)]
    assert sampler.sample(logits, rows) == logits[:, :vocab].argmax(-1).tolist()
    assert all(row.generator is None and row.counts is None for row in rows)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31), penalty=st.floats(0.3, 3.0),
    history=st.lists(st.integers(0, 39), max_size=30), temperature=st.sampled_from([0.0, 1.0]),
)
def test_repetition_penalty_matches_transformers(device, seed, penalty, history, temperature):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    vocab = 40
    logits = randn(1, vocab, seed=seed, device=device)
    sampler = BatchSampler(vocab, device)
    row = sampler.new_row(SamplingParams(temperature=temperature, repetition_penalty=penalty), 0, history)
    ids = torch.tensor([history or [0]], dtype=torch.long)
    scores = logits.cpu().clone()
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, scores) if history else scores
    if temperature == 0.0:
        assert sampler.sample(logits, [row]) == [int(expected.argmax())]
    else:
        got = sampler.distribution(logits, [row]).cpu().double()
        want = torch.softmax(expected, -1).double()
        # Two float32 softmaxes (the sampler's, with torch's exp, and torch.softmax) of logits that each
        # side penalised in float32: the penalty rounded to float32, then one product or quotient, 2u of
        # the logit from the exact one on each side.
        exact = torch.softmax(penalised_exactly(logits.cpu().double(), history, penalty), -1)
        logit_error = 2 * unit_roundoff(torch.float32) * float(expected.abs().max())
        bound = (softmax_error(exact, exp_ulps=TORCH_EXP_ULPS, logit_error=logit_error)
                 + softmax_error(exact, exp_ulps=TORCH_SOFTMAX_EXP_ULPS, logit_error=logit_error))
        assert bool(((got - want).abs() <= bound).all())


def penalised_exactly(logits: torch.Tensor, history: list[int], penalty: float) -> torch.Tensor:
    """HF's repetition penalty in float64: seen logits divided by the penalty, or multiplied if negative."""
    seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
    seen[history] = True
    return torch.where(seen & (logits > 0), logits / penalty, torch.where(seen, logits * penalty, logits))


def test_presence_and_frequency_penalties_follow_the_openai_formula(device):
    vocab = 8
    logits = randn(1, vocab, seed=3, device=device)
    params = SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=-0.4)
    sampler = BatchSampler(vocab, device)
    row = sampler.new_row(params, 0, [1, 1, 1, 5])
    counts = torch.bincount(torch.tensor([1, 1, 1, 5]), minlength=vocab).double()
    expected = logits.cpu().double() - 0.7 * (counts > 0) + 0.4 * counts
    want = torch.softmax(expected, -1)
    # Each of the two penalty steps computes l - c * k in float32: c's own rounding and the product's
    # (u * |c| * k each) and the difference's (u * |l - c * k|), under 3u of the largest magnitude M.
    magnitude = float(logits.abs().max()) + 0.7 + 0.4 * 3
    logit_error = 2 * 3 * unit_roundoff(torch.float32) * magnitude
    bound = softmax_error(want, exp_ulps=TORCH_EXP_ULPS, logit_error=logit_error)
    assert bool(((sampler.distribution(logits, [row]).cpu().double() - want).abs() <= bound).all())


params_strategy = st.builds(
    SamplingParams,
    temperature=st.floats(0.2, 3.0),
    top_k=st.one_of(st.just(0), st.integers(1, 60)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(FLOAT32_TINY, 1.0)),
)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), vocab=st.integers(2, 50), params=st.lists(params_strategy, min_size=1, max_size=5))
def test_filters_match_a_per_row_reference(device, seed, vocab, params):
    logits = randn(len(params), vocab + 3, seed=seed, device=device)
    for i, p in enumerate(params):
        assume(far_from_cuts(logits[i, :vocab], p))
    sampler = BatchSampler(vocab, device)
    rows = [sampler.new_row(p, i, []) for i, p in enumerate(params)]
    got = sampler.distribution(logits, rows).cpu().double()
    for i, p in enumerate(params):
        want = reference_distribution(logits[i, :vocab], p)
        assert (got[i] > 0).tolist() == (want > 0).tolist()
        # The same float32 logits / temperature on both sides; then the sampler's float32 softmax.
        assert bool(((got[i] - want).abs() <= softmax_error(want, exp_ulps=TORCH_EXP_ULPS)).all())


def test_cuts_keep_tied_logits_together(device):
    sampler = BatchSampler(4, device)
    logits = torch.tensor([[2.0, 1.0, 2.0, 0.0]] * 3, device=device)
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.1),
              SamplingParams(temperature=1.0, min_p=0.99)]
    got = sampler.distribution(logits, [sampler.new_row(p, 0, []) for p in params]).cpu().double()
    want = torch.tensor([[0.5, 0.0, 0.5, 0.0]] * 3, dtype=torch.float64)
    assert torch.equal(got > 0, want > 0)
    assert bool(((got - want).abs() <= softmax_error(want, exp_ulps=TORCH_EXP_ULPS)).all())


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3, top_p=0.95, min_p=0.05)]
)
def test_empirical_frequencies_match_the_distribution(device, params):
    probs = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.35])
    logits = probs.log().unsqueeze(0).to(device)
    sampler = BatchSampler(5, device)
    rows = [sampler.new_row(params, 1000 + i, []) for i in range(40)]
    expected = sampler.distribution(logits.expand(40, 5), rows)[0].cpu()
    counts = torch.zeros(5)
    for _ in range(100):  # 4000 draws, fixed seeds: the verdict cannot change between runs
        for token in sampler.sample(logits.expand(40, 5), rows):
            counts[token] += 1
    assert counts[expected == 0].sum() == 0
    support = expected > 0
    chi2 = float(((counts[support] - 4000 * expected[support]) ** 2 / (4000 * expected[support])).sum())
    assert chi2 < 20.5, (chi2, counts, expected)  # p = 0.0004 at the most degrees of freedom here (4)


def test_a_seeded_row_ignores_what_else_is_in_the_batch(device):
    vocab, steps = 300, 40
    target = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, **PENALTIES)
    others = [GREEDY, SamplingParams(temperature=1.5), SamplingParams(temperature=0.5, top_k=5, **PENALTIES),
              SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(repetition_penalty=1.2),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=2.0, top_k=200)]
    row_logits = [randn(vocab + 4, seed=s, device=device) for s in range(steps)]

    alone_sampler = BatchSampler(vocab, device)
    alone = alone_sampler.new_row(target, 42, [3, 3, 9])
    solo = [alone_sampler.sample(row_logits[s].unsqueeze(0), [alone])[0] for s in range(steps)]

    sampler = BatchSampler(vocab, device)
    mine = sampler.new_row(target, 42, [3, 3, 9])
    neighbours = [sampler.new_row(p, None if i % 2 else i, [1, 2]) for i, p in enumerate(others)]
    batched = []
    for s in range(steps):
        batch = neighbours[: s % 8]  # the batch changes size every step; the target sits at row 5 when it can
        batch = batch[:5] + [mine] + batch[5:]
        logits = randn(len(batch), vocab + 4, seed=10_000 + s, device=device)
        logits[batch.index(mine)] = row_logits[s]
        batched.append(sampler.sample(logits, batch)[batch.index(mine)])
    assert batched == solo
    assert torch.equal(mine.counts, alone.counts)  # whole counts, exact in float32


def test_unseeded_rows_draw_different_tokens(device):
    sampler = BatchSampler(1000, device)
    params = SamplingParams(temperature=1.0)
    a, b = sampler.new_row(params, None, []), sampler.new_row(params, None, [])
    flat = torch.zeros(2, 1000, device=device)
    draws = [sampler.sample(flat, [a, b]) for _ in range(20)]
    assert [x for x, _ in draws] != [y for _, y in draws]
    assert a.seed is not None and a.seed != b.seed  # the drawn seed is kept so an answer can be replayed


def test_penalty_counts_cover_the_prompt_and_every_sampled_token(device):
    vocab = 20
    sampler = BatchSampler(vocab, device)
    prompt = [4, 4, 7, 19, 0]
    rows = [sampler.new_row(SamplingParams(temperature=1.0, frequency_penalty=0.1), 5, prompt),
            sampler.new_row(SamplingParams(presence_penalty=0.5), None, prompt),
            sampler.new_row(SamplingParams(temperature=1.0), 5, prompt)]
    assert rows[2].counts is None
    sampled: list[list[int]] = [[], [], []]
    for step in range(15):
        for i, token in enumerate(sampler.sample(randn(3, vocab, seed=step, device=device), rows)):
            sampled[i].append(token)
    for i in (0, 1):
        expected = torch.bincount(torch.tensor(prompt + sampled[i]), minlength=vocab).float()
        assert torch.equal(rows[i].counts.cpu(), expected)  # whole counts, exact in float32


def test_sampled_tokens_feed_the_next_steps_penalty(device):
    # Flat logits and a presence penalty: greedy must walk through every unseen token in id order.
    sampler = BatchSampler(12, device)
    row = sampler.new_row(SamplingParams(presence_penalty=2.0), None, [0, 1, 2])
    flat = torch.zeros(1, 12, device=device)
    assert [sampler.sample(flat, [row])[0] for _ in range(9)] == list(range(3, 12))


def test_bad_rows_fail_alone(device):
    vocab = 16
    sampler = BatchSampler(vocab, device)
    params = SamplingParams(temperature=1.0, **PENALTIES)
    logits = randn(5, vocab + 2, seed=1, device=device)
    logits[1, 3] = float("nan")
    logits[2, :vocab] = float("-inf")
    logits[3, 5] = float("inf")
    rows = [sampler.new_row(params if i % 2 else GREEDY, i, [1]) for i in range(5)]
    before = [None if r.counts is None else r.counts.clone() for r in rows]
    out = sampler.sample(logits, rows)
    for i, needle in ((1, "NaN"), (2, "-inf"), (3, "+inf")):
        err = out[i]
        assert isinstance(err, SamplingError) and isinstance(err, DecodeError)
        assert err.row == i and needle in str(err) and str(err).startswith("sampling failed: ")
        assert (err.http_status, err.code) == (500, "sampling_error")
        assert pickle.loads(pickle.dumps(err)) == err
        if before[i] is not None:
            assert torch.equal(rows[i].counts, before[i])  # an erroring row records nothing
    assert isinstance(out[0], int) and isinstance(out[4], int)
    alone = BatchSampler(vocab, device)
    assert alone.sample(logits[4:5], [alone.new_row(GREEDY, 4, [1])]) == [out[4]]


def test_bad_calls_raise_value_errors(device):
    sampler = BatchSampler(10, device)
    row = sampler.new_row(GREEDY, None, [])
    with pytest.raises(ValueError, match="rows, vocab"):
        sampler.sample(torch.zeros(10, device=device), [row])
    with pytest.raises(ValueError, match="rows, vocab"):
        sampler.sample(torch.zeros(1, 1, 10, device=device), [row])
    with pytest.raises(ValueError, match="2 rows but 1"):
        sampler.sample(torch.zeros(2, 10, device=device), [row])
    with pytest.raises(ValueError, match="fewer than the vocabulary"):
        sampler.sample(torch.zeros(1, 9, device=device), [row])
    with pytest.raises(ValueError, match="floating point"):
        sampler.sample(torch.zeros(1, 10, dtype=torch.long, device=device), [row])
    with pytest.raises(TokenOutOfVocab):
        sampler.new_row(SamplingParams(repetition_penalty=1.1), None, [3, 10])
    with pytest.raises(ValueError, match="seed"):
        sampler.new_row(GREEDY, -1, [])
    assert sampler.sample(torch.zeros(0, 10, device=device), []) == []


def test_all_greedy_batches_never_sort(device, monkeypatch):
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("the all-greedy path sorted")

    monkeypatch.setattr(torch, "sort", boom)
    monkeypatch.setattr(torch, "topk", boom)
    sampler = BatchSampler(30, device)
    rows = [sampler.new_row(SamplingParams(repetition_penalty=1.2), None, [1]), sampler.new_row(GREEDY, 7, [])]
    logits = randn(2, 30, seed=0, device=device)
    assert sampler.sample(logits, rows)[1] == int(logits[1].argmax())


def test_row_state_is_small_and_typed(device):
    sampler = BatchSampler(10, device)
    row = sampler.new_row(SamplingParams(temperature=0.5), 3, [])
    assert isinstance(row, RowSampler) and not hasattr(row, "__dict__")
    assert row.seed == 3 and not row.greedy and row.generator.device.type == torch.device(device).type
    assert sampler.new_row(SamplingParams(temperature=1e-6), 3, []).greedy  # too cold to divide by


# --- the cheap top_p paths (CPU) against the full torch.sort ---------------------------------------------


def sorted_row_weights(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The filters as `_weights` computed them before the cheap top_p paths: one torch.sort of every row.

    Kept verbatim to pin that every path gives these bits.
    """
    n = x.shape[1]
    ks = [p.top_k if 0 < p.top_k < n else 0 for p in params]
    q = torch.tensor([[p.temperature, k, p.top_p, p.min_p] for p, k in zip(params, ks)], dtype=torch.float32)
    temperature, top_k, top_p, min_p = (c.unsqueeze(1) for c in q.unbind(1))
    l = x / temperature
    threshold = torch.full_like(temperature, float("-inf"))
    ordered = torch.sort(l, dim=-1, descending=True).values
    kth = ordered.gather(1, (top_k.long() - 1).clamp_(min=0))
    threshold = torch.where(top_k > 0, kth, threshold)
    probs = torch.softmax(ordered.masked_fill(ordered < threshold, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    keep = (before < top_p).sum(dim=-1, keepdim=True)
    threshold = torch.where(top_p < 1.0, torch.maximum(threshold, ordered.gather(1, keep - 1)), threshold)
    l = l.masked_fill(l < threshold, float("-inf"))
    weights = torch.exp(l - l.amax(dim=-1, keepdim=True))
    return weights.masked_fill(weights < min_p, 0.0)


def assorted_logits(rng: random.Random, b: int, n: int) -> torch.Tensor:
    """Peaked, flat, all-tied, coarsely quantised and tie-grouped rows, some with -inf holes."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    rows = []
    for _ in range(b):
        kind = rng.choice(["peaked", "peaked", "flat", "tied", "steps", "groups"])
        if kind == "peaked":
            row = torch.randn(n, generator=g) * rng.choice([1.0, 3.0, 6.0])
        elif kind == "flat":
            row = torch.randn(n, generator=g) * 1e-3
        elif kind == "tied":
            row = torch.full((n,), rng.choice([0.0, -2.5, 7.0]))
        elif kind == "steps":
            row = torch.randint(-4, 3, (n,), generator=g).float() * rng.choice([0.5, 2.0])
        else:  # a few tie groups over a noisy tail: top_k and top_p cuts land inside groups
            row = torch.randn(n, generator=g) - 4.0
            for value, size in ((6.0, rng.randint(1, 3)), (4.0, rng.randint(1, 40)), (3.0, rng.randint(1, 200))):
                row[torch.randperm(n, generator=g)[: min(size, n)]] = value
        if rng.random() < 0.2:
            row[torch.randperm(n, generator=g)[: n // 3]] = float("-inf")
        rows.append(row)
    return torch.stack(rows)


def assorted_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.3, 0.8, 1.0, 1.7]),
        top_p=rng.choice([1.0, 0.05, 0.3, 0.5, 0.9, 0.95, 0.99, 0.9999]),
        top_k=rng.choice([0, 0, 0, 1, 3, 20, 50, 700]),
        min_p=rng.choice([0.0, 0.0, 0.1]),
    )


@pytest.fixture
def full_sorts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records how many rows each call of the sampler's full sort took."""
    seen: list[int] = []
    real = cuts_module._sorted_values

    def recording(l: torch.Tensor) -> torch.Tensor:
        seen.append(l.shape[0])
        return real(l)

    monkeypatch.setattr(cuts_module, "_sorted_values", recording)
    return seen


def test_every_top_p_path_gives_the_torch_sort_bits(monkeypatch):
    rng = random.Random(20240607)
    for case in range(60):
        n = rng.choice([20, 300, 4000, 20000])
        b = rng.randint(1, 6)
        logits = assorted_logits(rng, b, n + 3)
        params = [assorted_params(rng) for _ in range(b)]
        seeds = [rng.randrange(2**63) for _ in range(b)]
        want = sorted_row_weights(logits[:, :n], params)
        want = want / want.sum(dim=-1, keepdim=True)
        got = {}
        # The CPU paths; top_k + top_p rows straight to the full sort; the sync-free path used off the CPU.
        for path in ("cpu", "no head", "sync-free"):
            with monkeypatch.context() as m:
                if path == "no head":
                    m.setattr(cuts_module, "_TOP_K_HEAD", False)
                if path == "sync-free":
                    m.setattr(cuts_module, "_reads_back", lambda device: False)
                sampler = BatchSampler(n, "cpu")
                rows = [sampler.new_row(p, seed, []) for p, seed in zip(params, seeds)]
                dist = sampler.distribution(logits, rows)
                got[path] = [sampler.sample(logits, rows) for _ in range(3)]
            assert torch.equal(dist, want), (case, path, params)
        assert got["cpu"] == got["no head"] == got["sync-free"], (case, params)


def test_the_top_k_head_sums_like_the_whole_sorted_row():
    # What _nucleus_from_top_k relies on: past the top_k cut the softmax only adds zeros.
    g = torch.Generator().manual_seed(0)
    for n in (100, 4096, 50257):
        ordered = torch.sort(torch.randn(6, n, generator=g) * 4, dim=-1, descending=True).values
        k = torch.randint(1, 60, (6, 1), generator=g)
        kth = ordered.gather(1, k - 1)
        whole = torch.softmax(ordered.masked_fill(ordered < kth, float("-inf")), dim=-1)
        for width in (16, 17, 61, 64, 100):
            head = ordered[:, :width]
            fits = (k < width).squeeze(1)  # the head holds every logit >= the k-th, and one more
            got = torch.softmax(head.masked_fill(head < kth, float("-inf")), dim=-1)
            assert torch.equal(got[fits], whole[fits, :width])


def test_cut_ties_stay_together_past_the_head(full_sorts):
    n = 5000
    sampler = BatchSampler(n, "cpu")
    # top_k = 3 lands in a group of 40 tied logits, more than the head of 16 holds.
    spill = torch.full((n,), -3.0)
    spill[:2] = torch.tensor([10.0, 9.0])
    spill[100:140] = 5.0
    # top_p = 0.2 lands inside a group of 100 tied logits worth 0.29 of the mass.
    group = torch.zeros(n)
    group[1000:1100] = 3.0
    # top_k = 3 and top_p = 0.5 with distinct logits: the head holds it all.
    peaked = randn(n, seed=4, device="cpu")
    logits = torch.stack([spill, group, peaked])
    params = [SamplingParams(temperature=1.0, top_k=3, top_p=0.99), SamplingParams(temperature=1.0, top_p=0.2),
              SamplingParams(temperature=1.0, top_k=3, top_p=0.5)]
    got = sampler.distribution(logits, [sampler.new_row(p, 0, []) for p in params])
    assert (got[0] > 0).nonzero().flatten().tolist() == [0, 1, *range(100, 140)]
    assert (got[1] > 0).nonzero().flatten().tolist() == list(range(1000, 1100))
    for i, p in enumerate(params):
        want = reference_distribution(logits[i], p)
        assert bool(((got[i].double() - want).abs() <= softmax_error(want, exp_ulps=TORCH_EXP_ULPS)).all()), i
    assert full_sorts == [1, 1]  # the spilling row, then the top_p row without top_k; the peaked row used its head


def test_temperature_and_min_p_rows_never_sort(device, monkeypatch):
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("a row without top_k or top_p sorted")

    monkeypatch.setattr(torch, "sort", boom)
    monkeypatch.setattr(torch, "topk", boom)
    monkeypatch.setattr(cuts_module, "_sorted_values", boom)
    sampler = BatchSampler(3000, device)
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, min_p=0.05), GREEDY,
              SamplingParams(temperature=1.3, min_p=0.5, repetition_penalty=1.1)]
    rows = [sampler.new_row(p, i, [1]) for i, p in enumerate(params)]
    logits = randn(4, 3000, seed=3, device=device)
    assert all(isinstance(t, int) for t in sampler.sample(logits, rows))
    assert sampler.distribution(logits, rows).shape == (4, 3000)


def test_only_top_k_and_top_p_rows_reach_a_sort(device, monkeypatch):
    calls: list[tuple[str, int]] = []

    def recording(module: object, name: str) -> None:
        real = getattr(module, name)

        def call(t: torch.Tensor, *args: object, **kwargs: object):
            calls.append((name, t.shape[0]))
            return real(t, *args, **kwargs)

        monkeypatch.setattr(module, name, call)

    for module, name in ((torch, "sort"), (torch, "topk"), (cuts_module, "_sorted_values")):
        recording(module, name)
    sampler = BatchSampler(3000, device)
    params = [SamplingParams(temperature=0.8, min_p=0.05), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=40, top_p=0.95)]
    rows = [sampler.new_row(p, i, []) for i, p in enumerate(params)]
    sampler.sample(randn(4, 3000, seed=5, device=device), rows)
    assert calls and all(size <= 2 for _, size in calls), calls


def test_bad_rows_fail_alone_under_top_k_and_top_p(device):
    vocab = 3000
    sampler = BatchSampler(vocab, device)
    logits = randn(4, vocab, seed=2, device=device)
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[3, 9] = float("inf")
    for params in (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=20, top_p=0.9)):
        out = sampler.sample(logits, [sampler.new_row(params, i, []) for i in range(4)])
        assert isinstance(out[0], int)
        assert [type(e) for e in out[1:]] == [SamplingError] * 3


def test_a_prefix_just_short_of_top_p_runs_on():
    # The running sum first covers _PREFIX sorted probabilities; top_p sits 3e-6 above their mass, so
    # the cut is the next token and the sum has to run on past the prefix.
    n, head = 5000, cuts_module._PREFIX
    logits = randn(n, seed=12, device="cpu", scale=0.01)
    logits[:head] += 5.0
    probs = torch.softmax(logits, 0)
    params = SamplingParams(temperature=1.0, top_p=float(probs[:head].sum()) + 3e-6)
    sampler = BatchSampler(n, "cpu")
    got = sampler.distribution(logits.unsqueeze(0), [sampler.new_row(params, 0, [])])
    want = sorted_row_weights(logits.unsqueeze(0), [params])
    assert torch.equal(got, want / want.sum()) and int((got > 0).sum()) == head + 1
