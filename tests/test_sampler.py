"""The batched sampler: greedy and filters against references, seeding, penalties, per-row errors."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ferrox_batch.errors import DecodeError, TokenOutOfVocab
from ferrox_batch.generate import SamplingParams
from ferrox_batch.models.sampler import BatchSampler, RowSampler, SamplingError

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


def far_from_cuts(logits: torch.Tensor, p: SamplingParams, margin: float = 1e-4) -> bool:
    """False when float32 vs float64 rounding could move a top_p or min_p cut (hypothesis skips those)."""
    l = (logits.float() / p.temperature).double().cpu()
    if 0 < p.top_k < len(l):
        l = l.masked_fill(l < torch.sort(l, descending=True).values[p.top_k - 1], -math.inf)
    probs = torch.sort(torch.softmax(l, 0), descending=True).values
    before = torch.cumsum(probs, 0) - probs
    ok = p.top_p == 1.0 or bool(((before - torch.tensor(p.top_p, dtype=torch.float32).double()).abs() > margin).all())
    return ok and (p.min_p == 0.0 or bool(((probs / probs[0] - p.min_p).abs() > margin).all()))


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
        got = sampler.distribution(logits, [row]).cpu()
        torch.testing.assert_close(got, torch.softmax(expected, -1), atol=1e-5, rtol=0)


def test_presence_and_frequency_penalties_follow_the_openai_formula(device):
    vocab = 8
    logits = randn(1, vocab, seed=3, device=device)
    params = SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=-0.4)
    sampler = BatchSampler(vocab, device)
    row = sampler.new_row(params, 0, [1, 1, 1, 5])
    counts = torch.bincount(torch.tensor([1, 1, 1, 5]), minlength=vocab).double()
    expected = logits.cpu().double() - 0.7 * (counts > 0) + 0.4 * counts
    torch.testing.assert_close(sampler.distribution(logits, [row]).cpu().double(), torch.softmax(expected, -1), atol=1e-5, rtol=0)


params_strategy = st.builds(
    SamplingParams,
    temperature=st.floats(0.2, 3.0),
    top_k=st.one_of(st.just(0), st.integers(1, 60)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
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
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=0)


def test_cuts_keep_tied_logits_together(device):
    sampler = BatchSampler(4, device)
    logits = torch.tensor([[2.0, 1.0, 2.0, 0.0]] * 3, device=device)
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.1),
              SamplingParams(temperature=1.0, min_p=0.99)]
    got = sampler.distribution(logits, [sampler.new_row(p, 0, []) for p in params]).cpu()
    torch.testing.assert_close(got, torch.tensor([[0.5, 0.0, 0.5, 0.0]] * 3))


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
    torch.testing.assert_close(mine.counts, alone.counts)


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
        torch.testing.assert_close(rows[i].counts.cpu(), expected)


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
            torch.testing.assert_close(rows[i].counts, before[i])  # an erroring row records nothing
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
