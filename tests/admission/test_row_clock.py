"""`RowClock` (docs/upstream.md, Results and timing), on an injected clock so every number is exact."""

from __future__ import annotations

import time

import pytest

from ferrox_batch.admission.clock import RowClock
from ferrox_batch.usage import Usage


class FakeClock:
    """A monotonic source the test advances by hand."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def test_a_finished_row_reports_both_rates() -> None:
    now = FakeClock()
    clock = RowClock.start(now)
    now.advance(2.0)  # prefill
    clock.prefill_finished()
    now.advance(0.5)
    clock.token()
    now.advance(3.5)  # the rest of decode
    usage = clock.usage(41, 32)
    assert isinstance(usage, Usage)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (41, 32, 73)
    assert usage.prompt_per_second == pytest.approx(41 / 2.0)
    assert usage.predicted_per_second == pytest.approx(32 / 4.0)
    assert usage.prompt_eval_duration_ms == pytest.approx(2000.0)
    assert usage.generation_duration_ms == pytest.approx(4000.0)
    assert usage.time_to_first_token_ms == pytest.approx(2500.0)
    assert "cached_tokens" not in usage.to_dict(), "no prefix cache, so nothing claims a cache hit"


def test_a_finished_row_reports_both_rates_on_the_real_clock() -> None:
    clock = RowClock.start()
    time.sleep(0.002)
    clock.prefill_finished()
    clock.token()
    time.sleep(0.002)
    usage = clock.usage(41, 32)
    assert usage.prompt_per_second is not None
    assert usage.predicted_per_second is not None
    assert usage.time_to_first_token_ms is not None


def test_only_the_first_token_sets_ttft() -> None:
    now = FakeClock()
    clock = RowClock(now)
    clock.prefill_finished()
    now.advance(1.0)
    clock.token()
    first = clock.first_token
    now.advance(5.0)
    clock.token()
    assert clock.first_token == first, "a later token moved the TTFT"
    assert clock.usage(3, 2).time_to_first_token_ms == pytest.approx(1000.0)


def test_a_row_that_never_decoded_has_no_decode_rate() -> None:
    now = FakeClock()
    clock = RowClock.start(now)
    now.advance(1.5)
    usage = clock.usage(41, 0)
    assert usage.predicted_per_second is None
    assert usage.time_to_first_token_ms is None
    assert usage.generation_duration_ms == 0.0, "an unfinished prefill has an empty decode phase"
    assert usage.prompt_eval_duration_ms == pytest.approx(1500.0), "prefill runs to the end"
    assert usage.prompt_per_second == pytest.approx(41 / 1.5)


def test_queue_wait_is_not_prefill_time() -> None:
    now = FakeClock()
    now.advance(60.0)  # waiting in the queue: before the clock starts
    clock = RowClock.start(now)
    now.advance(1.0)
    clock.prefill_finished()
    assert clock.usage(10, 0).prompt_eval_duration_ms == pytest.approx(1000.0)


def test_a_clock_that_runs_backwards_yields_empty_phases_not_negative_ones() -> None:
    now = FakeClock(50.0)
    clock = RowClock(now)
    now.t = 49.0
    clock.prefill_finished()
    clock.token()
    now.t = 48.0
    usage = clock.usage(2, 2)
    assert usage.prompt_eval_duration_ms == 0.0
    assert usage.generation_duration_ms == 0.0
    assert usage.time_to_first_token_ms == 0.0
    assert usage.prompt_per_second is None and usage.predicted_per_second is None


def test_the_two_constructors_start_the_clock_alike() -> None:
    now = FakeClock(7.0)
    assert RowClock(now).started == RowClock.start(now).started == 7.0
    assert RowClock(now).prefill_done is None and RowClock(now).first_token is None


@pytest.mark.parametrize(
    ("args", "error", "name"),
    [
        ((-1, 0), ValueError, "prompt_tokens"),
        ((1.0, 0), TypeError, "prompt_tokens"),
        ((True, 0), TypeError, "prompt_tokens"),
        ((1, -1), ValueError, "completion_tokens"),
        ((1, "2"), TypeError, "completion_tokens"),
    ],
)
def test_bad_counts_are_refused_by_name(args: tuple, error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        RowClock(FakeClock()).usage(*args)


def test_a_bad_time_source_is_refused() -> None:
    with pytest.raises(TypeError, match="now must be"):
        RowClock(5.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="now"):
        RowClock(lambda: "soon")  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="now"):
        RowClock(lambda: float("nan"))
    values = iter([1.0, None])
    clock = RowClock(lambda: next(values))  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="now"):
        clock.prefill_finished()
