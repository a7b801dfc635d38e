"""How requests end, with no model: length, stop tokens, stop strings, `ignore_eos`, a sampler error or a
detokenizer failure on one row, and a sink that refuses text; each leaves through one flush with one reply."""

from __future__ import annotations

from scheduler_fakes import Bench

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.errors import InternalError
from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.replies import Chunk, Finished
from ferrox_batch.scheduler.request import RequestStatus


def test_a_request_ends_at_max_tokens_and_its_last_token_is_not_fed():
    bench = Bench(BatcherConfig())
    request = bench.submit([1, 2], 3)
    fed = []
    while not bench.scheduler.idle:
        plan = bench.step(lambda r: 4)
        fed += [tokens for _, tokens in plan.inputs]
    assert bench.sink(request).result.token_ids == (4, 4, 4)
    assert bench.sink(request).result.finish_reason == FinishReason.LENGTH
    assert fed == [[1, 2], [4], [4]]  # the third token finished it: never fed
    bench.assert_nothing_held()


def test_a_stop_token_ends_the_request_and_is_not_output():
    bench = Bench(BatcherConfig())
    request = bench.submit([1], 10, stop_tokens=[7])
    tokens = iter([3, 4, 7, 5])
    bench.run_until_idle(lambda r: next(tokens))
    result = bench.sink(request).result
    assert result.finish_reason == FinishReason.STOP and result.token_ids == (3, 4) and result.text == "DE"


def test_ignore_eos_generates_through_stop_tokens():
    bench = Bench(BatcherConfig())
    request = bench.submit([1], 3, stop_tokens=[7], ignore_eos=True)
    bench.run_until_idle(lambda r: 7)
    assert bench.sink(request).result.token_ids == (7, 7, 7)


def test_a_stop_string_ends_the_request_and_its_text_is_held_back():
    bench = Bench(BatcherConfig())
    request = bench.submit([1], 10, stop=["CD"])
    tokens = iter([0, 1, 2, 3, 4])  # A B C D E
    bench.run_until_idle(lambda r: next(tokens))
    sink = bench.sink(request)
    assert sink.result.finish_reason == FinishReason.stop_sequence("CD")
    assert sink.text == sink.result.text == "AB"


def test_text_streams_to_the_sink_before_the_one_final_event():
    bench = Bench(BatcherConfig())
    request = bench.submit([1], 3)
    tokens = iter([0, 1, 2])
    bench.run_until_idle(lambda r: next(tokens))
    events = bench.sink(request).events
    assert events[:3] == [Chunk("A"), Chunk("B"), Chunk("C")]
    assert isinstance(events[3], Finished) and len(events) == 4


def test_a_sampling_error_fails_that_request_only():
    bench = Bench(BatcherConfig(max_prefills_per_tick=4))
    bad = bench.submit([1], 5)
    good = bench.submit([2], 5)
    error = InternalError("sampling failed: logits contain NaN")
    bench.run_until_idle(lambda r: error if r is bad else 3)
    assert bench.sink(bad).result == error
    assert bench.sink(good).result.token_ids == (3,) * 5
    bench.assert_nothing_held()


def test_a_detokenizer_failure_fails_that_request_only():
    bench = Bench(BatcherConfig(max_prefills_per_tick=4))

    def decode(ids):
        if ids == [13]:
            raise UnicodeError("broken vocabulary entry")
        return b"x"

    bench.scheduler.decode = decode
    bad = bench.submit([1], 5)
    good = bench.submit([2], 5)
    bench.run_until_idle(lambda r: 13 if r is bad else 3)
    assert isinstance(bench.sink(bad).result, InternalError)
    assert bench.sink(good).result.text == "xxxxx"
    bench.assert_nothing_held()


def test_a_sink_that_refuses_text_cancels_its_request_and_frees_it():
    bench = Bench(BatcherConfig(max_prefills_per_tick=4))
    request = bench.submit([1], 50)
    other = bench.submit([2], 5)

    def refuse(text: str) -> None:
        raise ConnectionError("client went away")

    bench.sink(request).chunk = refuse
    bench.run_until_idle()
    assert bench.sink(request).result.finish_reason == FinishReason.CANCELLED
    assert len(bench.sink(other).result.token_ids) == 5
    bench.assert_nothing_held()


def test_usage_counts_prompt_and_generated_tokens_with_rates():
    bench = Bench(BatcherConfig())
    request = bench.submit([1, 2, 3], 4)
    bench.run_until_idle()
    usage = bench.sink(request).result.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 4, 7)
    assert usage.time_to_first_token_ms is not None


def test_update_refuses_a_runner_that_sampled_the_wrong_number_of_tokens():
    bench = Bench(BatcherConfig())
    bench.submit([1], 3)
    plan = bench.scheduler.schedule()
    bench.kv.run(plan)
    try:
        bench.scheduler.update(plan, [1, 2])
    except RuntimeError as error:
        assert "sampled 2 tokens for 1 requests" in str(error)
    else:
        raise AssertionError("a miscounted update was accepted")


def test_a_kv_store_that_disagrees_with_the_computed_tokens_fails_that_request_alone():
    bench = Bench(BatcherConfig())
    lost = bench.submit([1, 2, 3], 3)
    plan = bench.scheduler.schedule()  # the fake forward never runs for it: the store holds nothing
    bench.scheduler.update(plan, [1])
    error = bench.sink(lost).result
    assert isinstance(error, InternalError) and "the KV store holds 0" in str(error)
    # The scheduler goes on: the next request runs to its end and nothing stays held.
    fine = bench.submit([4, 5], 2)
    bench.run_until_idle()
    assert isinstance(bench.sink(fine).result, GenerationResult)
    bench.assert_nothing_held()


def test_finished_requests_are_marked_finished():
    bench = Bench(BatcherConfig())
    request = bench.submit([1], 2)
    bench.run_until_idle()
    assert request.status is RequestStatus.FINISHED
