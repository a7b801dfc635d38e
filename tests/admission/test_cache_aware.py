"""The bounded cache-aware admission pick (docs/upstream.md, Admission and D13): upstream unit tests
and starvation/FIFO properties of a simulated admission loop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.admission.cache_aware import MAX_SKIPS, WINDOW, choose


def queued(n: int) -> list[int]:
    return [0] * n


def test_the_bounds_are_the_upstream_ones() -> None:
    assert (WINDOW, MAX_SKIPS) == (8, 4)


def test_a_cold_server_is_still_fifo() -> None:
    assert choose([0, 0, 0], queued(3)) == 0


def test_equal_depth_keeps_arrival_order() -> None:
    assert choose([64, 64, 64], queued(3)) == 0


def test_the_deepest_hit_in_the_window_goes_first() -> None:
    assert choose([0, 64, 512], queued(3)) == 2


def test_fewer_than_two_jobs_pick_the_head() -> None:
    assert choose([], []) == 0
    assert choose([99], [0]) == 0


def test_a_job_cannot_be_passed_over_forever() -> None:
    skips = queued(2)
    admitted_head_after = None
    for round_ in range(MAX_SKIPS + 3):
        pick = choose([0, 4096], skips)  # the second job always wins on depth
        if pick == 0:
            admitted_head_after = round_
            break
        for i in range(pick):
            skips[i] += 1
        del skips[pick]
        skips.append(0)
    assert admitted_head_after == MAX_SKIPS, "the head must be admitted after exactly MAX_SKIPS skips"


def test_the_scan_stops_at_a_job_that_has_reached_the_bound() -> None:
    skips = queued(3)
    skips[1] = MAX_SKIPS
    assert choose([0, 0, 4096], skips) == 0, "a job behind one at the bound must not be pulled in front of it"


def test_nothing_past_the_window_is_considered() -> None:
    depths = [0] * (WINDOW + 2)
    depths[WINDOW + 1] = 999_999
    assert choose(depths, queued(WINDOW + 2)) == 0
    depths[WINDOW - 1] = 1
    assert choose(depths, queued(WINDOW + 2)) == WINDOW - 1, "the last job inside the window is reachable"


def test_reordering_alone_saves_nothing_when_hits_cannot_be_lost() -> None:
    prompt, depths = 1000, [0, 900, 900]

    def total(order: list[int]) -> int:
        return sum(prompt - depths[i] for i in order)

    assert total([0, 1, 2]) == total([1, 2, 0])


def test_under_eviction_pressure_the_policy_prefills_fewer_tokens() -> None:
    prompt, start = 1000, [0, 900, 900]

    def run(order: list[int]) -> int:
        # Every cold admission turns the page pool over: the jobs still
        # waiting lose their cached prefix.
        depth, tokens = list(start), 0
        for pos, i in enumerate(order):
            hit = depth[i]
            tokens += prompt - hit
            if hit == 0:
                for j in order[pos + 1 :]:
                    depth[j] = 0
        return tokens

    assert choose(start, queued(3)) == 1, "the deepest hit should go first"
    assert (run([0, 1, 2]), run([1, 2, 0])) == (3000, 1200)


# ---------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    ("depths", "skips", "error", "name"),
    [
        ([0, 1], [0], ValueError, "same jobs"),
        ([0, -1], [0, 0], ValueError, r"depths\[1\]"),
        ([0, 1], [0, -2], ValueError, r"skips\[1\]"),
        ([0, 1.5], [0, 0], TypeError, r"depths\[1\]"),
        ([0, True], [0, 0], TypeError, r"depths\[1\]"),
        ([0, 1], [False, 0], TypeError, r"skips\[0\]"),
        ("01", [0, 0], TypeError, "depths"),
        ([0, 1], None, TypeError, "skips"),
        ({0, 1}, [0, 0], TypeError, "depths"),
    ],
)
def test_malformed_queues_are_refused_by_name(depths: object, skips: object, error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        choose(depths, skips)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Properties of a simulated admission loop


depth_values = st.sampled_from([0, 0, 0, 16, 64, 512, 4096])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(depth_values, min_size=1, max_size=20),
    st.lists(st.lists(depth_values, max_size=3), max_size=30),
)
def test_no_job_is_overtaken_more_than_max_skips_times(initial: list[int], arrivals: list[list[int]]) -> None:
    """Admit one job per tick while new jobs keep arriving: every admitted job
    was passed over at most MAX_SKIPS times, and every pick is either the head
    or a job strictly deeper than everything it jumped, inside the window."""
    queue = [{"id": i, "depth": d, "skips": 0} for i, d in enumerate(initial)]
    next_id = len(queue)
    ticks = list(arrivals) + [[] for _ in range(len(initial) + sum(map(len, arrivals)))]
    for new in ticks:
        for d in new:
            queue.append({"id": next_id, "depth": d, "skips": 0})
            next_id += 1
        if not queue:
            continue
        pick = choose([j["depth"] for j in queue], [j["skips"] for j in queue])
        assert 0 <= pick < min(len(queue), WINDOW)
        if pick:
            assert all(queue[pick]["depth"] > j["depth"] for j in queue[:pick])
        for j in queue[:pick]:
            j["skips"] += 1
        assert all(j["skips"] <= MAX_SKIPS for j in queue)
        queue.pop(pick)
    assert not queue


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=30), st.lists(st.integers(min_value=0, max_value=MAX_SKIPS + 2), max_size=30))
def test_a_cold_server_admits_in_arrival_order(n: int, skips: list[int]) -> None:
    skips = (skips + [0] * n)[:n]
    assert choose([0] * n, skips) == 0
    order, queue = [], list(range(n))
    while queue:
        pick = choose([0] * len(queue), [0] * len(queue))
        order.append(queue.pop(pick))
    assert order == list(range(n))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10), min_size=1, max_size=12),
       st.lists(st.integers(min_value=0, max_value=MAX_SKIPS + 1), min_size=12, max_size=12))
def test_the_pick_is_the_first_strictly_deepest_before_any_job_at_the_bound(depths: list[int], all_skips: list[int]) -> None:
    skips = all_skips[: len(depths)]
    pick = choose(depths, skips)
    if len(depths) < 2 or skips[0] >= MAX_SKIPS:
        assert pick == 0
        return
    reachable = 1
    while reachable < min(len(depths), WINDOW) and skips[reachable] < MAX_SKIPS:
        reachable += 1
    best = max(depths[:reachable])
    assert pick == depths[:reachable].index(best)
