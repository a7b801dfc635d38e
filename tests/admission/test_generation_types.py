"""The request/response vocabulary: the DecodeError family, FinishReason, Usage, params, results."""

from __future__ import annotations

import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.cancel import CancelToken
from ferrox_batch.checks import UNLIMITED, check_int
from ferrox_batch.errors import (
    BatcherClosed,
    DecodeError,
    InvalidRequest,
    KvBudgetExceeded,
    KvPoolExhausted,
    QueueFull,
    TokenOutOfVocab,
    WorkerDied,
)
from ferrox_batch.generation_types import FinishReason, GenerationParams, GenerationResult, SamplingParams
from ferrox_batch.usage import Usage

# --- DecodeError: messages are behaviour, kept verbatim -------------------------------------


def test_every_error_message_is_the_upstream_wording():
    assert str(TokenOutOfVocab(70000, 32000)) == (
        "prompt encoded to token id 70000, which is outside this model's vocabulary of 32000 "
        "(its tokenizer does not match this checkpoint)"
    )
    assert str(KvPoolExhausted()) == (
        "server is at capacity: the shared KV cache block pool has no free blocks for a new "
        "request; retry shortly"
    )
    assert str(QueueFull(3, 4)) == (
        "server is at capacity: 3 requests are already queued for the batch scheduler "
        "(limit 4); retry shortly"
    )
    assert str(KvBudgetExceeded("context_length_exceeded", 1, 2, 3, 4, "prompt is too long")) == (
        "context_length_exceeded: prompt is too long"
    )
    assert str(BatcherClosed()) == "the batch scheduler has been closed; no new requests are accepted"
    assert str(WorkerDied("RuntimeError: boom")) == "the batch scheduler's worker stopped: RuntimeError: boom"


ALL_ERRORS: list[DecodeError] = [
    TokenOutOfVocab(5, 4),
    KvPoolExhausted(),
    QueueFull(0, 0),
    KvBudgetExceeded("device_memory_budget_exceeded", 10, 20, 30, 40, "detail"),
    InvalidRequest("top_p", 2.0, "must be a number in (0, 1]"),
    BatcherClosed(),
    WorkerDied("cause"),
]


@pytest.mark.parametrize(
    ("error", "status", "retry"),
    [
        (TokenOutOfVocab(5, 4), 400, None),
        (KvPoolExhausted(), 503, 1),
        (QueueFull(1, 1), 503, 1),
        (KvBudgetExceeded("context_length_exceeded", 0, 0, 0, 0, "d"), 400, None),
        (InvalidRequest("max_tokens", -1, "must be a non-negative integer"), 400, None),
        (BatcherClosed(), 503, None),
        (WorkerDied("c"), 500, None),
    ],
)
def test_only_the_busy_kinds_ask_for_a_retry(error, status, retry):
    assert error.http_status == status
    assert error.retry_after_secs == retry
    assert error.is_retryable() == (retry is not None)
    assert isinstance(error, DecodeError)


@pytest.mark.parametrize("error", ALL_ERRORS, ids=lambda e: type(e).__name__)
def test_every_error_has_an_openai_shaped_body_and_survives_pickling(error):
    body = error.to_dict()
    assert set(body) == {"error"}
    assert body["error"]["message"] == str(error)
    assert isinstance(body["error"]["type"], str) and isinstance(body["error"]["code"], str)
    clone = pickle.loads(pickle.dumps(error))
    assert clone == error and str(clone) == str(error) and type(clone) is type(error)
    assert type(error).__name__ in repr(error)


def test_a_kv_budget_refusal_carries_its_numbers_and_its_binding_as_the_code():
    err = KvBudgetExceeded("context_length_exceeded", 640, 384, 10, 6, "prompt is too long: 10 tokens > 6 maximum")
    assert err.to_dict() == {
        "error": {
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
            "message": "context_length_exceeded: prompt is too long: 10 tokens > 6 maximum",
            "estimated_bytes": 640,
            "limit_bytes": 384,
            "positions": 10,
            "positions_limit": 6,
        }
    }


def test_a_kv_budget_refusal_with_an_unknown_binding_is_a_bug_not_a_message():
    with pytest.raises(ValueError, match="binding"):
        KvBudgetExceeded("out_of_luck", 0, 0, 0, 0, "d")


def test_errors_compare_by_variant_and_fields():
    assert QueueFull(0, 0) == QueueFull(0, 0)
    assert QueueFull(0, 0) != QueueFull(0, 1)
    assert KvPoolExhausted() == KvPoolExhausted()
    assert len({QueueFull(1, 2), QueueFull(1, 2)}) == 1


def test_an_invalid_request_is_also_a_value_error_and_names_its_param():
    err = InvalidRequest("top_k", -1, "must be an integer >= 0 (0 disables it)")
    assert isinstance(err, ValueError)
    assert str(err) == "top_k must be an integer >= 0 (0 disables it), got -1"
    assert err.to_dict()["error"]["param"] == "top_k"
    assert hash(InvalidRequest("stop", [1], "x")) == hash(InvalidRequest("stop", [1], "x"))


def test_an_invalid_request_quotes_a_long_value_short_and_keeps_it_whole():
    huge = ["stop"] * 100_000
    err = InvalidRequest("stop", huge, "is too long")
    assert str(err) == "stop is too long, got <list of length 100000>"
    assert err.value is huge and err == InvalidRequest("stop", list(huge), "is too long")
    medium = "x" * 200
    assert str(InvalidRequest("prompt", medium, "is bad")) == f"prompt is bad, got {repr(medium)[:77]}..."


# --- FinishReason ----------------------------------------------------------------------------


def test_finish_reasons_report_their_openai_strings():
    assert FinishReason.STOP.as_str() == "stop"
    assert FinishReason.stop_sequence("###").as_str() == "stop"
    assert FinishReason.LENGTH.as_str() == "length"
    assert FinishReason.CANCELLED.as_str() == "cancelled"


def test_only_a_stop_sequence_names_its_stop_and_only_a_cancel_is_incomplete():
    assert FinishReason.stop_sequence("</s>").matched_stop() == "</s>"
    for reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED):
        assert reason.matched_stop() is None
    assert FinishReason.STOP.completed() and FinishReason.LENGTH.completed()
    assert FinishReason.stop_sequence("x").completed()
    assert not FinishReason.CANCELLED.completed()


def test_finish_reasons_compare_by_value():
    assert FinishReason.stop_sequence("x") == FinishReason.stop_sequence("x")
    assert FinishReason.stop_sequence("x") != FinishReason.stop_sequence("y")
    assert FinishReason.stop_sequence("x") != FinishReason.STOP
    assert FinishReason("length") == FinishReason.LENGTH
    assert len({FinishReason.STOP, FinishReason("stop")}) == 1


def test_a_malformed_finish_reason_is_refused():
    with pytest.raises(ValueError):
        FinishReason("eos")
    with pytest.raises(ValueError):
        FinishReason("stop", "x")
    with pytest.raises(ValueError):
        FinishReason("stop_sequence")
    with pytest.raises(TypeError):
        FinishReason.stop_sequence(3)  # type: ignore[arg-type]


# --- Usage -----------------------------------------------------------------------------------


def test_usage_totals_prompt_and_completion():
    usage = Usage.new(7, 5)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (7, 5, 12)


def test_a_plain_usage_serialises_to_exactly_the_three_counts():
    assert Usage.new(2, 3).to_dict() == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


def test_usage_reports_separate_rates_for_the_two_phases():
    usage = Usage.new(100, 20).with_timings(0.5, 2.0)
    assert usage.prompt_per_second == pytest.approx(200.0)
    assert usage.predicted_per_second == pytest.approx(10.0)
    assert usage.prompt_eval_duration_ms == pytest.approx(500.0)
    assert usage.generation_duration_ms == pytest.approx(2000.0)


def test_usage_never_reports_an_infinite_or_meaningless_rate():
    zero_time = Usage.new(10, 5).with_timings(0.0, 0.0)
    assert zero_time.prompt_per_second is None and zero_time.predicted_per_second is None
    assert zero_time.prompt_eval_duration_ms == 0.0 and zero_time.generation_duration_ms == 0.0
    zero_tokens = Usage.new(0, 0).with_timings(1.0, 1.0)
    assert zero_tokens.prompt_per_second is None and zero_tokens.predicted_per_second is None


def test_ttft_is_unset_when_nothing_was_generated():
    assert Usage.new(4, 0).with_ttft(0.25).time_to_first_token_ms is None
    assert Usage.new(4, 1).with_ttft(0.25).time_to_first_token_ms == pytest.approx(250.0)


def test_usage_builders_return_a_new_value_and_leave_the_old_one_alone():
    base = Usage.new(3, 4)
    timed = base.with_timings(1.0, 1.0)
    assert timed is not base and base.prompt_per_second is None
    with pytest.raises(AttributeError):
        base.prompt_tokens = 9  # type: ignore[misc]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None])
def test_usage_refuses_counts_that_are_not_counts(bad):
    with pytest.raises((TypeError, ValueError), match="prompt_tokens"):
        Usage(bad, 0)  # type: ignore[arg-type]


def test_usage_refuses_a_contradictory_total_and_bad_durations():
    with pytest.raises(ValueError, match="total_tokens"):
        Usage(1, 1, 3)
    with pytest.raises(ValueError, match="prefill_s"):
        Usage.new(1, 1).with_timings(-1.0, 0.0)
    with pytest.raises(ValueError, match="decode_s"):
        Usage.new(1, 1).with_timings(0.0, float("nan"))
    with pytest.raises(TypeError, match="ttft"):
        Usage.new(1, 1).with_ttft("soon")  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(
    p=st.integers(0, 10**6),
    c=st.integers(0, 10**6),
    prefill=st.floats(0, 100),
    decode=st.floats(0, 100),
)
def test_usage_rates_are_finite_and_present_only_when_meaningful(p, c, prefill, decode):
    usage = Usage.new(p, c).with_timings(prefill, decode)
    assert usage.total_tokens == p + c
    # Present exactly when the phase took time and produced tokens (a subnormal
    # duration whose quotient overflows to inf is dropped rather than sent).
    assert (usage.prompt_per_second is not None) == (prefill > 0 and p > 0 and math.isfinite(p / prefill))
    assert (usage.predicted_per_second is not None) == (decode > 0 and c > 0 and math.isfinite(c / decode))
    for rate in (usage.prompt_per_second, usage.predicted_per_second):
        assert rate is None or math.isfinite(rate)


# --- SamplingParams / GenerationParams --------------------------------------------------------


def test_default_sampling_is_greedy_with_every_filter_off():
    s = SamplingParams()
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.0, 1.0, 0, 0.0)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.0, 0.0, 0.0)
    assert s.is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -1),
        ("top_k", -1),
        ("top_k", 2.0),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3),
        ("frequency_penalty", None),
    ],
)
def test_sampling_params_refuse_out_of_range_values_by_name(field, value):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert field in str(info.value) and repr(value) in str(info.value)


def test_sampling_edges_are_accepted():
    SamplingParams(temperature=0, top_p=1, top_k=0, min_p=1.0, presence_penalty=-2, frequency_penalty=2)
    SamplingParams(top_p=1e-9, min_p=0.0, repetition_penalty=1e-6)


def test_generation_params_normalise_lists_to_tuples_and_a_bare_stop_string_to_one_stop():
    params = GenerationParams(8, stop=["a", "bc"], stop_token_ids=[1, 2])
    assert params.stop == ("a", "bc") and params.stop_token_ids == (1, 2)
    assert GenerationParams(8, stop="###").stop == ("###",)
    assert GenerationParams(8).stop == () and GenerationParams(8).stop_token_ids == ()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 1.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": UNLIMITED + 1}, "max_tokens"),
        ({"max_tokens": 1, "seed": 1.5}, "seed"),
        ({"max_tokens": 1, "seed": -1}, "seed"),
        ({"max_tokens": 1, "seed": True}, "seed"),
        ({"max_tokens": 1, "stop": ["a", 3]}, "stop"),
        ({"max_tokens": 1, "stop": 3}, "stop"),
        ({"max_tokens": 1, "stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"max_tokens": 1, "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_tokens": 1, "stop_token_ids": [False]}, "stop_token_ids"),
        ({"max_tokens": 1, "stop_token_ids": 5}, "stop_token_ids"),
        ({"max_tokens": 1, "stop_token_ids": "12"}, "stop_token_ids"),
        ({"max_tokens": 1, "cancel": object()}, "cancel"),
        ({"max_tokens": 1, "ignore_eos": 1}, "ignore_eos"),
        ({"max_tokens": 1, "cache_salt": 7}, "cache_salt"),
        ({"max_tokens": 1, "cache_salt": ""}, "cache_salt"),
        ({"max_tokens": 1, "sampling": {"temperature": 1.0}}, "sampling"),
    ],
)
def test_generation_params_refuse_impossible_values_by_name(kwargs, field):
    with pytest.raises(InvalidRequest) as info:
        GenerationParams(**kwargs)
    assert info.value.param == field
    assert str(info.value).startswith(field)
    assert info.value.http_status == 400


def test_zero_and_the_largest_position_count_are_valid_budgets():
    assert GenerationParams(0).max_tokens == 0
    assert GenerationParams(UNLIMITED).max_tokens == UNLIMITED
    assert GenerationParams(1, seed=UNLIMITED).seed == UNLIMITED


def test_a_request_is_cancelled_only_through_its_token():
    assert not GenerationParams(4).is_cancelled()
    token = CancelToken()
    params = GenerationParams(4, cancel=token)
    assert not params.is_cancelled()
    token.cancel()
    assert params.is_cancelled()


def test_with_max_tokens_copies_and_shares_the_cancel_token():
    token = CancelToken()
    params = GenerationParams(100, seed=3, stop=["x"], cancel=token, cache_salt="s")
    clamped = params.with_max_tokens(2)
    assert clamped.max_tokens == 2 and params.max_tokens == 100
    assert clamped.cancel is token and clamped.stop == ("x",) and clamped.seed == 3
    with pytest.raises(InvalidRequest):
        params.with_max_tokens(-5)


# --- GenerationResult ------------------------------------------------------------------------


def test_a_result_unpacks_as_the_upstream_four_tuple():
    result = GenerationResult(FinishReason.LENGTH, [1, 2], "ab", Usage.new(3, 2))
    finish, ids, text, usage = result
    assert finish == FinishReason.LENGTH and ids == (1, 2) and text == "ab" and usage == Usage.new(3, 2)
    assert result[2] == "ab" and len(result) == 4
    assert result == GenerationResult(FinishReason.LENGTH, (1, 2), "ab", Usage.new(3, 2))


def test_a_result_refuses_the_wrong_types():
    with pytest.raises(TypeError):
        GenerationResult("length", [], "", Usage.new(0, 0))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        GenerationResult(FinishReason.STOP, [], b"", Usage.new(0, 0))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        GenerationResult(FinishReason.STOP, [], "", (0, 0))  # type: ignore[arg-type]


# --- check_int -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [True, False, 1.0, "1", None])
def test_check_int_refuses_non_integers_including_bools(bad):
    with pytest.raises(TypeError, match="widgets"):
        check_int("widgets", bad)


def test_check_int_names_the_range_it_enforces():
    assert check_int("n", 0) == 0
    with pytest.raises(ValueError, match=r"n must be >= 1, got 0"):
        check_int("n", 0, minimum=1)
    with pytest.raises(ValueError, match="n must be <="):
        check_int("n", UNLIMITED + 1)
