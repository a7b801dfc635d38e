"""What one forward holds, with no model: the step budget, several prompts a tick, prompt order, the step
target's cap, and the plan's row order (decodes first, then prompt chunks; who samples)."""

from __future__ import annotations

from scheduler_fakes import Bench

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.admission.step_budget import MIN_PREFILL_CHUNK
from ferrox_batch.scheduler.request import RequestStatus


def test_a_long_prompt_runs_in_chunks_of_prefill_chunk():
    bench = Bench(BatcherConfig(prefill_chunk=32, max_batch_tokens=256))
    request = bench.submit(list(range(1, 50)), 2)
    sizes = []
    while request.status is not RequestStatus.DECODING:
        plan = bench.step()
        sizes.append(plan.prompt_tokens)
    assert sizes == [32, 17]
    assert request.num_computed_tokens == 49


def test_decode_rows_take_their_share_of_the_token_budget():
    # 40 rows decode: the prompt gets what is left of 64 tokens, never less than the floor.
    bench = Bench(BatcherConfig(prefill_chunk=64, max_batch_tokens=64, max_prefills_per_tick=1))
    for _ in range(40):
        bench.submit([1], 50)
    for _ in range(40):
        bench.step()
    assert len(bench.scheduler.decoding) == 40
    prompt = bench.submit(list(range(1, 60)), 2)
    plan = bench.step()
    assert len(plan.decodes) == 40
    assert plan.prompts[0].request is prompt
    assert plan.prompt_tokens == max(MIN_PREFILL_CHUNK, 64 - 40)


def test_a_saturated_batch_still_advances_prompts_by_the_floor():
    bench = Bench(BatcherConfig(prefill_chunk=128, max_batch_tokens=8, max_prefills_per_tick=1))
    for _ in range(20):
        bench.submit([1], 30)
    for _ in range(20):
        bench.step()
    bench.submit([5] * 99, 1)
    plan = bench.step()
    assert len(plan.decodes) == 20 and plan.prompt_tokens == MIN_PREFILL_CHUNK


def test_several_prompts_share_a_tick_up_to_max_prefills_per_tick():
    bench = Bench(BatcherConfig(prefill_chunk=16, max_batch_tokens=40, max_prefills_per_tick=3))
    requests = [bench.submit(list(range(1, 11)), 2) for _ in range(5)]
    plan = bench.step()
    assert [c.request for c in plan.prompts] == requests[:3]
    assert [len(c.tokens) for c in plan.prompts] == [10, 10, 10]


def test_later_prompts_get_what_the_first_left_of_the_budget():
    bench = Bench(BatcherConfig(prefill_chunk=16, max_batch_tokens=24, max_prefills_per_tick=4))
    bench.submit(list(range(1, 21)), 2)
    bench.submit(list(range(1, 21)), 2)
    plan = bench.step()
    assert [len(c.tokens) for c in plan.prompts] == [16, 8]


def test_one_prompt_a_tick_is_round_robin():
    bench = Bench(BatcherConfig(prefill_chunk=16, max_batch_tokens=16, max_prefills_per_tick=1))
    a = bench.submit([1] * 40, 2)
    b = bench.submit([2] * 40, 2)
    order = [bench.step().prompts[0].request for _ in range(4)]
    assert order == [a, b, a, b]


def test_several_prompts_a_tick_keep_unfinished_ones_at_the_front():
    bench = Bench(BatcherConfig(prefill_chunk=16, max_batch_tokens=20, max_prefills_per_tick=2))
    a = bench.submit([1] * 40, 2)
    b = bench.submit([2] * 40, 2)
    c = bench.submit([3] * 40, 2)
    firsts = [bench.step().prompts[0].request for _ in range(3)]
    assert firsts == [a, a, a]  # first come, first finished
    assert c.num_computed_tokens == 0 and b.num_computed_tokens > 0


def test_a_prompt_samples_after_the_forward_that_ran_its_last_chunk():
    bench = Bench(BatcherConfig(prefill_chunk=16, max_batch_tokens=16))
    request = bench.submit([1] * 20, 3)
    first = bench.step()
    assert first.sampling == () and request.output_ids == []
    second = bench.step(lambda r: 7)
    assert second.sampling == (request,) and request.output_ids == [7]
    assert request.status is RequestStatus.DECODING


def test_decodes_come_first_and_feed_their_last_sampled_token():
    bench = Bench(BatcherConfig(max_prefills_per_tick=1))
    decoding = bench.submit([1, 2], 5)
    bench.step(lambda r: 9)
    prompt = bench.submit([3, 4, 5], 5)
    plan = bench.step(lambda r: 11)
    assert plan.decodes == (decoding,) and [c.request for c in plan.prompts] == [prompt]
    assert list(plan.inputs) == [(decoding.seq_id, [9]), (prompt.seq_id, [3, 4, 5])]
    assert plan.sampling == (decoding, prompt)
    assert decoding.output_ids == [9, 11] and prompt.output_ids == [11]


def test_an_empty_prompt_prefills_one_stand_in_token():
    bench = Bench(BatcherConfig())
    request = bench.submit([], 2)
    plan = bench.step()
    assert list(plan.inputs) == [(request.seq_id, [0])]
    bench.run_until_idle()
    result = bench.sink(request).result
    assert result.usage.prompt_tokens == 0 and len(result.token_ids) == 2


def test_the_step_target_caps_prompt_tokens_while_rows_decode():
    bench = Bench(BatcherConfig(prefill_chunk=256, max_batch_tokens=1024, max_prefills_per_tick=8,
                                step_target_ms=40))
    cost = bench.scheduler.step_cost
    for rows, tokens in ((0, 100), (4, 0), (2, 50), (0, 300), (8, 20)):
        cost.observe(rows, tokens, 0.010 + 0.001 * tokens)
    alone = bench.submit([1] * 300, 30)
    plan = bench.step()
    assert plan.prompt_tokens == 256  # nobody decodes: no cap
    while alone.status is not RequestStatus.DECODING:
        bench.step()
    bench.submit([2] * 300, 2)
    plan = bench.step()
    assert len(plan.decodes) == 1
    assert plan.prompt_tokens == cost.prompt_allowance(1, 0.040)
    assert 28 <= plan.prompt_tokens <= 30  # 30 ms left of the target at 1 ms a token, up to the fit's rounding


def test_the_step_target_learns_from_the_ticks_update_is_given():
    bench = Bench(BatcherConfig(step_target_ms=100))
    bench.submit([1] * 10, 3)
    bench.step(seconds=0.05)
    assert bench.scheduler.step_cost.prompt_ticks == 1
    no_target = Bench(BatcherConfig())
    no_target.submit([1] * 10, 3)
    no_target.step(seconds=0.05)
    assert no_target.scheduler.step_cost.prompt_ticks == 0
