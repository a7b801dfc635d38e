"""Verifying drafts: the one-call path for memoryless rows is the position-by-position loop, exactly.

`ModelRunner._verify` samples the drafted positions of plain greedy rows (`RowSampler.memoryless`) in one
call and every other row position by position. Pinned here against the loop alone, on random steps that mix
every kind of row (greedy, log-probabilities, `logit_bias`, `allowed_token_ids`, `min_tokens`, multi-token
bad words, penalties, seeded sampling), drafts that agree for a while then part, tied logits and NaN
positions: the same kept outcomes (a sampling error's `row` is an index into whichever call drew it, so
errors compare by kind), the same row states after, and the same KV lengths.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.errors import DecodeError
from ferrox_batch.forward import RowToSample
from ferrox_batch.generation_types import SamplingParams
from ferrox_batch.runtime.runner import ModelRunner
from ferrox_batch.runtime.sampling.sampler import BatchSampler

VOCAB = 40
CONTEXT = 20
ROW_KINDS = {
    "greedy": (SamplingParams(), {}),
    "logprobs": (SamplingParams(), {"logprobs": 3}),
    "bias": (SamplingParams(logit_bias=((5, 4.0), (6, -100.0))), {}),
    "allowed": (SamplingParams(allowed_token_ids=tuple(range(0, VOCAB, 2))), {}),
    "min_tokens": (SamplingParams(), {"held": (3, 4), "hold_for": 2}),
    "bad_words": (SamplingParams(bad_words_ids=((7, 8),)), {}),
    "penalty": (SamplingParams(repetition_penalty=1.3), {}),
    "seeded": (SamplingParams(temperature=0.8, top_k=10), {"seed": 11}),
}


@pytest.fixture(scope="module")
def tiny_decoder(tiny_batch_model):
    return tiny_batch_model.decoder


def step(decoder, kinds: list[str], drafts: list[tuple[int, ...]], spans: list[torch.Tensor], at_once: bool):
    """One drafted step's verification on a fresh runner: (kept outcomes, row states, KV lengths)."""
    runner = ModelRunner(decoder, decoder.new_store(8, num_blocks=64), BatchSampler(VOCAB, "cpu"))
    if not at_once:
        runner._verify_at_once = lambda sampling, alive, spans, kept: alive
    sampling = []
    for i, (kind, draft) in enumerate(zip(kinds, drafts)):
        params, extra = ROW_KINDS[kind]
        seq_id = runner.allocate(CONTEXT + len(draft) + 1)
        runner.store.seq(seq_id).length = CONTEXT + len(draft) + 1  # the forward wrote every drafted position
        sampling.append(RowToSample(seq_id, i, params, extra.get("seed"), extra.get("logprobs"), [1, 2, 7], None,
                                    extra.get("held", ()), extra.get("hold_for", 0), draft))
    outcomes, ready = runner._rows(sampling)
    rows = [runner._samplers[s.seq_id] for s in sampling]
    sampled = runner._sample(sampling, torch.stack([span[0] for span in spans]), outcomes, ready, rows, None)
    runner._verify(sampling, list(range(len(kinds))), dict(enumerate(spans)), sampled)
    kept = [tuple(type(o).__name__ if isinstance(o, DecodeError) else o for o in outcome) for outcome in sampled]
    states = [(None if r.counts is None else r.counts.tolist(), r.hold_left, list(r.recent),
               None if r.generator is None else r.generator.get_state().tolist()) for r in rows]
    lengths = [runner.store.seq(s.seq_id).length for s in sampling]
    return kept, states, lengths


@st.composite
def steps(draw):
    n = draw(st.integers(1, 5))
    kinds = draw(st.lists(st.sampled_from(sorted(ROW_KINDS)), min_size=n, max_size=n))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    drafts, spans = [], []
    for _ in range(n):
        length = draw(st.integers(1, 6))
        # Logits on a coarse grid, so ties happen; now and then a position is NaN.
        span = torch.randint(-4, 5, (length + 1, VOCAB), generator=gen).float() / 2
        for p in draw(st.lists(st.integers(0, length), max_size=1)):
            span[p, 0] = float("nan")
        agree = draw(st.integers(0, length))  # the draft is the argmax for a while, then anything
        draft = [int(span[p].nan_to_num(-1e9).argmax()) if p < agree else draw(st.integers(0, VOCAB - 1))
                 for p in range(length)]
        drafts.append(tuple(draft))
        spans.append(span)
    return kinds, drafts, spans


@settings(max_examples=200, deadline=None)
@given(steps())
def test_one_call_verification_is_the_position_by_position_loop(tiny_decoder, step_inputs):
    kinds, drafts, spans = step_inputs
    assert step(tiny_decoder, kinds, drafts, spans, True) == step(tiny_decoder, kinds, drafts, spans, False)
