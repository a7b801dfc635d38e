"""The step target: the worker learns what a tick costs and keeps ticks with decoding rows under a time target."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from batch_helpers import greedy_params, sequential_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from test_prefills_per_tick import RecordingDecoder
from worker_helpers import drain_reply, make_request, make_worker

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.admission.step_budget import MIN_PREFILL_CHUNK
from ferrox_batch.scheduler.step_cost import (
    _RIDGE,
    _ROW_SCALE,
    _TOKEN_SCALE,
    FORGETTING,
    MIN_PROMPT_TICKS,
    StepCostModel,
)

costs = st.tuples(st.floats(0.0, 0.2), st.floats(0.0, 0.01), st.floats(1e-5, 5e-3))
ticks = st.lists(st.tuples(st.integers(0, 128), st.integers(0, 2048)), min_size=8, max_size=60)


def trained(fixed: float, per_row: float, per_token: float, seen: list[tuple[int, int]]) -> StepCostModel:
    model = StepCostModel()
    for rows, tokens in seen:
        model.observe(rows, tokens, fixed + per_row * rows + per_token * tokens)
    return model


@settings(max_examples=150, deadline=None)
@given(cost=costs, seen=ticks, noise=st.lists(st.floats(-0.02, 0.02), min_size=60, max_size=60))
def test_the_fit_is_the_weighted_least_squares_fit_of_the_ticks_it_saw(cost, seen, noise):
    """Each tick weighted FORGETTING**(newer ticks of its own kind: with or without prompt tokens)."""
    fixed, per_row, per_token = cost
    model = StepCostModel()
    kept = []
    for (rows, tokens), jitter in zip(seen, noise):
        seconds = max(0.0, fixed + per_row * rows + per_token * tokens + jitter)
        model.observe(rows, tokens, seconds)
        if rows or tokens:
            kept.append(((1.0, rows / _ROW_SCALE, tokens / _TOKEN_SCALE), seconds, tokens > 0))
    x = np.array([f for f, _, _ in kept]).reshape(len(kept), 3)
    y = np.array([t for _, t, _ in kept])
    kind = np.array([p for _, _, p in kept], dtype=bool)
    newer = np.array([int((kind[k + 1:] == kind[k]).sum()) for k in range(len(kept))])
    w = FORGETTING ** newer
    normal = (x.T * w) @ x + _RIDGE * np.eye(3)
    want = np.linalg.solve(normal, (x.T * w) @ y)
    # Both sides solve the same 3x3 system in float64: they agree to its condition number's rounding.
    tolerance = 1e-12 * np.linalg.cond(normal) * max(1.0, float(np.abs(want).max()))
    assert np.allclose(model.coef, want, rtol=0, atol=tolerance)


@settings(max_examples=100, deadline=None)
@given(cost=costs)
def test_ticks_of_many_shapes_teach_the_true_cost(cost):
    fixed, per_row, per_token = cost
    model = trained(fixed, per_row, per_token, [(r, t) for r in (0, 8, 32, 64) for t in (0, 64, 512, 1024)])
    # Exact data, a well-conditioned design: only the 1e-9 ridge stands between fit and truth.
    for rows, tokens in ((1, 16), (32, 0), (16, 256), (128, 2048)):
        assert model.predict(rows, tokens) == pytest.approx(fixed + per_row * rows + per_token * tokens, abs=1e-5)


@settings(max_examples=150, deadline=None)
@given(cost=costs, rows=st.integers(1, 128), target_ms=st.integers(1, 2000))
def test_the_allowance_keeps_a_tick_under_the_target(cost, rows, target_ms):
    fixed, per_row, per_token = cost
    seen = [(r, t) for r in (0, 8, 32, 64) for t in (0, 64, 512, 1024)]
    model = trained(fixed, per_row, per_token, seen)
    target = target_ms / 1000
    allowance = model.prompt_allowance(rows, target)
    assert allowance is not None and allowance >= 0
    if model.predict(rows, 0) >= target:
        assert allowance == 0  # the decode step alone reaches the target: no prompt token fits
    else:
        assert model.predict(rows, allowance) <= target, "the allowed prompt tokens fit the target"
        assert model.predict(rows, allowance + 1) > target, "and it allows all that fit"


def test_no_cap_before_the_fit_knows_a_prompt_token_or_when_nobody_decodes():
    model = StepCostModel()
    assert model.prompt_allowance(8, 0.1) is None
    for _ in range(MIN_PROMPT_TICKS - 1):
        model.observe(0, 512, 0.5)
        model.observe(8, 0, 0.05)
    assert model.prompt_allowance(8, 0.1) is None
    model.observe(4, 256, 0.3)
    assert model.prompt_allowance(8, 0.1) is not None
    assert model.prompt_allowance(0, 0.1) is None, "a tick without decoding rows stalls nobody"
    assert model.tick_tokens(1024, 8, None) == 1024
    assert model.tick_tokens(1024, 0, 100) == 1024
    assert model.tick_tokens(1024, 8, 100) == 8 + model.prompt_allowance(8, 0.1) < 1024


def test_a_tick_that_measured_nothing_teaches_nothing():
    model = StepCostModel()
    model.observe(0, 0, 1.0)
    model.observe(4, 16, float("nan"))
    assert model.coef == [0.0, 0.0, 0.0] and model.prompt_ticks == 0


def test_the_target_is_read_from_the_environment_and_validated():
    assert BatcherConfig.from_env({"FERROX_CB_STEP_TARGET_MS": "250"}).step_target_ms == 250
    assert BatcherConfig.from_env({}).step_target_ms is None  # the upstream tick has no time cap
    assert BatcherConfig.serving().step_target_ms is not None
    with pytest.raises(ValueError, match="FERROX_CB_STEP_TARGET_MS must be a positive integer"):
        BatcherConfig.from_env({"FERROX_CB_STEP_TARGET_MS": "0"})
    with pytest.raises(ValueError, match="step_target_ms"):
        BatcherConfig(step_target_ms=0)


class KnownCost(StepCostModel):
    """A cost model fixed at 10 ms + 1 ms per prompt token, whatever the tiny model's real ticks take."""

    def __init__(self) -> None:
        super().__init__()
        for rows, tokens in ((0, 100), (4, 0), (2, 50), (0, 300), (8, 20)):
            super().observe(rows, tokens, 0.010 + 0.001 * tokens)

    def observe(self, rows: int, prompt_tokens: int, seconds: float) -> None:
        pass


def test_the_worker_caps_prompt_tokens_while_rows_decode_and_answers_do_not_change(tiny_batch_model):
    decoder = RecordingDecoder(tiny_batch_model.decoder)
    config = BatcherConfig(prefill_chunk=256, max_batch_tokens=1024, kv_block_size=16, kv_blocks=256,
                           max_prefills_per_tick=8, step_target_ms=40)  # 30 prompt tokens fit, past the 10 ms
    worker = make_worker(SimpleNamespace(decoder=decoder), config)
    worker.scheduler.step_cost = cost = KnownCost()
    prompts = [[(5 * i + j) % 200 + 3 for j in range(40 + 30 * i)] for i in range(6)]
    params = greedy_params(8, ignore_eos=True)
    replies = []
    for prompt in prompts:
        request, reply = make_request(worker, prompt, params)
        worker.jobs.put(request)
        replies.append(reply)
        worker.tick()  # each prompt arrives while the earlier ones prefill or decode
    for _ in range(200):
        if worker.scheduler.idle:
            break
        worker.tick()
    results = [drain_reply(reply)[1][-1] for reply in replies]
    for prompt, result in zip(prompts, results):
        assert list(result.token_ids) == sequential_ids(tiny_batch_model, prompt, params)
    mixed = [(decodes, lens) for decodes, lens in decoder.forwards if decodes and lens]
    assert mixed, "some tick held decoding rows and prompt tokens together"
    for decodes, lens in mixed:
        assert sum(lens) <= max(cost.prompt_allowance(decodes, 0.040), MIN_PREFILL_CHUNK)
    alone = [lens for decodes, lens in decoder.forwards if not decodes and lens]
    assert max(sum(lens) for lens in alone) > 30, "ticks without decoding rows are not capped"


def test_a_long_run_of_decode_only_ticks_keeps_the_fit_and_its_precision():
    fixed, per_row, per_token = 0.02, 0.004, 0.0016
    model = trained(fixed, per_row, per_token, [(r, t) for r in (0, 8, 32) for t in (0, 128, 1024)])
    before = model.prompt_allowance(16, 0.4)
    for i in range(30_000):  # long answers, no prompt arriving: nothing informs the per-token cost
        rows = 1 + i % 32
        model.observe(rows, 0, fixed + per_row * rows)
    assert all(math.isfinite(c) for c in model.coef)
    assert model.prompt_allowance(16, 0.4) == before, "the per-token cost was kept"
    # And prompts re-teach it when it changed meanwhile: after 200 prompt ticks the old ones weigh 0.97**200.
    for k in range(200):
        tokens = (64, 256, 512, 1024)[k % 4]
        model.observe(16, tokens, fixed + per_row * 16 + 2 * per_token * tokens)
    assert model.seconds_per_prompt_token() == pytest.approx(2 * per_token, rel=1e-2)


def test_the_worker_teaches_the_model_from_its_own_ticks_only_with_a_target(tiny_batch_model):
    prompts = [[(3 * i + j) % 200 + 3 for j in range(20 + 10 * i)] for i in range(4)]
    for target, learns in ((None, False), (400, True)):
        config = BatcherConfig(prefill_chunk=16, max_batch_tokens=64, kv_block_size=16, kv_blocks=64,
                               step_target_ms=target)
        worker = make_worker(tiny_batch_model, config)
        for prompt in prompts:
            request, _ = make_request(worker, prompt, greedy_params(4, ignore_eos=True))
            worker.jobs.put(request)
        for _ in range(100):
            worker.tick()
            if worker.scheduler.idle:
                break
        assert worker.scheduler.idle
        assert (worker.scheduler.step_cost.prompt_ticks >= MIN_PROMPT_TICKS) is learns
        assert (worker.scheduler.step_cost.coef != [0.0, 0.0, 0.0]) is learns
