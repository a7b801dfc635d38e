"""Operator status lines (docs/upstream.md, Status lines): the upstream `status` unit tests, the
exact line formats, and bad input."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.admission import config
from ferrox_batch.admission.status import (
    DEFAULT_DECODE_LOG_INTERVAL,
    BatchStatus,
    PoolUsage,
    PrefillSnapshot,
    StatusReporter,
    throughput,
    usage_ratio,
)


def batch_status() -> BatchStatus:
    return BatchStatus(running_reqs=2, queue_reqs=1, kv_pages=PoolUsage(used=50, total=200), page_size=16)


def test_the_default_interval_is_the_upstream_one_and_shared_with_config() -> None:
    assert DEFAULT_DECODE_LOG_INTERVAL == 40 == config.DEFAULT_DECODE_LOG_INTERVAL


def test_a_status_line_never_divides_by_zero() -> None:
    assert usage_ratio(3, 4) == 0.75
    assert usage_ratio(3, 0) == 0.0
    assert throughput(120, 2.0) == 60.0
    assert throughput(120, 0.0) == 0.0
    assert throughput(120, -1.0) == 0.0


def test_evictable_entries_are_memory_and_not_occupancy() -> None:
    # Seven usable slots: five evictable, one free, one held by a live request.
    usage = PoolUsage.from_available(7, 1 + 5)
    assert (usage.used, usage.total) == (1, 7)
    assert usage.ratio() == pytest.approx(1 / 7)
    naive = PoolUsage.from_available(7, 1)
    assert naive.used == 6, "counting evictable as used is what this test rejects"


def test_every_pool_gauge_counts_availability_the_same_way() -> None:
    kv = PoolUsage.from_available(200, 50 + 30)
    assert (kv.used, kv.total) == (120, 200)


def test_a_double_counted_unit_reads_as_an_empty_pool_not_a_wrapped_one() -> None:
    assert PoolUsage.from_available(4, 9) == PoolUsage(0, 4)


def test_the_empty_values() -> None:
    assert PoolUsage.empty() == PoolUsage() == PoolUsage(0, 0)
    assert PoolUsage.empty().ratio() == 0.0
    assert PrefillSnapshot.empty() == PrefillSnapshot() == PrefillSnapshot(0, 0, 0)


def test_only_the_kv_pool_is_on_the_line() -> None:
    # The upstream also prints sliding-window and recurrent pools for models that have them; ours only
    # ever has the paged KV pool, and a pool it does not have is never shown as `0/0`.
    reporter = StatusReporter(1, 0.0)
    line = reporter.report_prefill(1.0, PrefillSnapshot.empty(), batch_status())
    assert "swa" not in line and "mamba" not in line and "0/0" not in line, line
    line = reporter.report_decode(2.0, 1, batch_status())
    assert line is not None
    assert "swa" not in line and "mamba" not in line, line


def test_decode_lines_are_emitted_only_every_nth_forward() -> None:
    reporter = StatusReporter(3, 0.0)
    status = dataclasses.replace(batch_status(), kv_pages=PoolUsage(60, 200), queue_reqs=0)
    assert reporter.report_decode(1.0, 2, status) is None
    assert reporter.report_decode(1.5, 2, status) is None
    status = dataclasses.replace(status, queue_reqs=4, kv_pages=PoolUsage(62, 200))
    line = reporter.report_decode(2.0, 2, status)
    assert line is not None, "the third forward logs"
    assert line.startswith("Decode batch, ")
    assert "#running-req: 2, " in line
    assert "#token: 992, " in line, "62 pages of 16"
    assert "token usage: 0.31, " in line
    assert "#queue-req: 4" in line
    assert "gen throughput (token/s): 3.00" in line, "6 tokens over 2.0s"
    assert [reporter.report_decode(2.0 + i, 2, status) is None for i in range(1, 4)] == [True, True, False]


def test_decode_throughput_covers_the_interval_and_not_the_whole_run() -> None:
    reporter = StatusReporter(2, 0.0)
    status = dataclasses.replace(batch_status(), kv_pages=PoolUsage(1, 10), page_size=1)
    assert reporter.report_decode(1.0, 5, status) is None
    line = reporter.report_decode(2.0, 5, status)
    assert line is not None and "gen throughput (token/s): 5.00" in line, "10 tokens over 2.0s"
    assert reporter.report_decode(3.0, 3, status) is None
    line = reporter.report_decode(4.0, 3, status)
    assert line is not None and "gen throughput (token/s): 3.00" in line, "6 tokens over the last 2.0s"
    assert "gen throughput (token/s): 4.00" not in line, "a lifetime average would read 16 over 4.0s"


def test_a_zero_gap_and_an_unallocated_pool_still_render() -> None:
    reporter = StatusReporter(1, 0.0)
    status = dataclasses.replace(batch_status(), kv_pages=PoolUsage.empty(), page_size=1)
    line = reporter.report_decode(0.0, 4, status)
    assert line is not None
    assert "gen throughput (token/s): 0.00" in line
    assert "token usage: 0.00" in line
    assert "#token: 0, " in line
    line = reporter.report_prefill(0.0, PrefillSnapshot.empty(), status)
    assert "input throughput (token/s): 0.00" in line


def test_the_decode_interval_is_clamped_to_at_least_one_forward() -> None:
    reporter = StatusReporter(0, 0.0)
    assert reporter.decode_log_interval == 1
    assert reporter.report_decode(1.0, 1, batch_status()) is not None


def test_a_prefill_line_reports_the_schedule_time_snapshot_verbatim() -> None:
    reporter = StatusReporter(DEFAULT_DECODE_LOG_INTERVAL, 0.0)
    line = reporter.report_prefill(0.5, PrefillSnapshot(new_seqs=1, new_tokens=512, cached_tokens=300), batch_status())
    assert line == (
        "Prefill batch, #new-seq: 1, #new-token: 512, #cached-token: 300, token usage: 0.25, "
        "#running-req: 2, #queue-req: 1, input throughput (token/s): 1024.00"
    )
    # The next line's throughput covers the gap since this one.
    line = reporter.report_prefill(2.5, PrefillSnapshot(2, 6, 0), batch_status())
    assert line.endswith("input throughput (token/s): 3.00")


def test_full_lines_are_verbatim() -> None:
    status = BatchStatus(running_reqs=3, queue_reqs=5, kv_pages=PoolUsage(10, 40), page_size=4)
    reporter = StatusReporter(1, 10.0)
    assert reporter.report_prefill(12.0, PrefillSnapshot(2, 6, 1), status) == (
        "Prefill batch, #new-seq: 2, #new-token: 6, #cached-token: 1, token usage: 0.25, "
        "#running-req: 3, #queue-req: 5, input throughput (token/s): 3.00"
    )
    assert reporter.report_decode(14.0, 3, status) == (
        "Decode batch, #running-req: 3, #token: 40, token usage: 0.25, "
        "gen throughput (token/s): 0.75, #queue-req: 5"
    )


def test_a_clock_that_steps_back_reports_zero_throughput() -> None:
    reporter = StatusReporter(1, 5.0)
    line = reporter.report_prefill(4.0, PrefillSnapshot(1, 10, 0), batch_status())
    assert line.endswith("input throughput (token/s): 0.00")


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=1, max_value=6),
    st.lists(st.tuples(st.integers(min_value=0, max_value=64), st.integers(min_value=1, max_value=1000)), max_size=30),
)
def test_decode_lines_come_every_interval_and_account_for_every_token(
    interval: int, forwards: list[tuple[int, int]]
) -> None:
    reporter = StatusReporter(interval, 0.0)
    now, since, tokens = 0.0, 0.0, 0
    for n, (reqs, ms) in enumerate(forwards, start=1):
        now += ms / 1000
        tokens += reqs
        line = reporter.report_decode(now, reqs, batch_status())
        assert (line is not None) == (n % interval == 0)
        if line is not None:
            assert line.endswith(f"gen throughput (token/s): {tokens / (now - since):.2f}, #queue-req: 1")
            since, tokens = now, 0


# ---------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    ("call", "error", "name"),
    [
        (lambda: usage_ratio(-1, 4), ValueError, "used"),
        (lambda: usage_ratio(1, 4.0), TypeError, "total"),
        (lambda: usage_ratio(True, 4), TypeError, "used"),
        (lambda: throughput(-5, 1.0), ValueError, "tokens"),
        (lambda: throughput(5.0, 1.0), TypeError, "tokens"),
        (lambda: throughput(5, "1"), TypeError, "seconds"),
        (lambda: throughput(5, True), TypeError, "seconds"),
        (lambda: throughput(5, float("nan")), ValueError, "seconds"),
        (lambda: PoolUsage(-1, 4), ValueError, "used"),
        (lambda: PoolUsage(5, 4), ValueError, "used"),
        (lambda: PoolUsage(1, 4.0), TypeError, "total"),
        (lambda: PoolUsage.from_available(4, -1), ValueError, "available"),
        (lambda: PoolUsage.from_available(True, 1), TypeError, "total"),
        (lambda: PrefillSnapshot(new_seqs=-1), ValueError, "new_seqs"),
        (lambda: PrefillSnapshot(new_tokens=1.5), TypeError, "new_tokens"),
        (lambda: PrefillSnapshot(cached_tokens=None), TypeError, "cached_tokens"),
        (lambda: BatchStatus(-1, 0, PoolUsage(), 16), ValueError, "running_reqs"),
        (lambda: BatchStatus(0, 0.5, PoolUsage(), 16), TypeError, "queue_reqs"),
        (lambda: BatchStatus(0, 0, (0, 0), 16), TypeError, "kv_pages"),
        (lambda: BatchStatus(0, 0, PoolUsage(), True), TypeError, "page_size"),
        (lambda: StatusReporter(-1, 0.0), ValueError, "interval"),
        (lambda: StatusReporter(2.0, 0.0), TypeError, "interval"),
        (lambda: StatusReporter(2, None), TypeError, "now"),
        (lambda: StatusReporter(2, float("nan")), ValueError, "now"),
        (lambda: StatusReporter().report_prefill("1", PrefillSnapshot(), batch_status()), TypeError, "now"),
        (lambda: StatusReporter().report_prefill(1.0, (1, 2, 3), batch_status()), TypeError, "snapshot"),
        (lambda: StatusReporter().report_prefill(1.0, PrefillSnapshot(), None), TypeError, "status"),
        (lambda: StatusReporter().report_decode(1.0, -2, batch_status()), ValueError, "batch_reqs"),
        (lambda: StatusReporter().report_decode(1.0, 2.0, batch_status()), TypeError, "batch_reqs"),
        (lambda: StatusReporter().report_decode(1.0, 2, {}), TypeError, "status"),
    ],
)
def test_bad_input_is_refused_by_name(call, error: type, name: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=name):
        call()


def test_a_refused_decode_call_is_not_counted() -> None:
    reporter = StatusReporter(2, 0.0)
    with pytest.raises(TypeError):
        reporter.report_decode(1.0, 1, None)  # type: ignore[arg-type]
    assert reporter.report_decode(1.0, 1, batch_status()) is None, "the refused call was not a forward"
    assert reporter.report_decode(2.0, 1, batch_status()) is not None
