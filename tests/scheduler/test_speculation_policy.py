"""How long a row's drafts are, and when it sits drafting out (`scheduler.speculation`), model-free.

Pins: the next draft's length stays within [1, `speculative_tokens`]; a draft kept whole makes it
`speculative_tokens`, one whose first `a` tokens were kept makes it `a + 1` (1 for one rejected whole);
`MAX_MISSES` whole rejections in a row pause the row's drafting for `PAUSE_STEPS` steps (steps that could
not draft count too), then it drafts again, each pause with no token kept since the one before twice as
long (up to `2**MAX_BACKOFF` times); no draft reaches past `max_tokens`; the rows that draft in one step
share one row's positions (each drafts at least one token; a paused row takes no share); speculation off,
a batch wider than `speculative_max_batch` or a step with prompts to prefill drafts nothing.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.generation_types import GenerationParams
from ferrox_batch.scheduler.request import Request
from ferrox_batch.scheduler.sink import OnceSink, QueueSink
from ferrox_batch.scheduler.speculation import MAX_BACKOFF, MAX_MISSES, PAUSE_STEPS, draft_for, drafted, plan_drafts
from ferrox_batch.stop_tokens import StopTokens

#: A prompt that repeats, so a draft is always found (a loop of one token copies on as that token).
LOOP = [7] * 12


def row(max_tokens: int = 1000) -> Request:
    request = Request(list(LOOP), GenerationParams(max_tokens=max_tokens), StopTokens.default(), OnceSink(QueueSink()),
                      abort=0, blocks=1, positions=1)
    request.output_ids.append(7)
    return request


def config(k: int = 8, **more) -> BatcherConfig:
    return BatcherConfig(speculative=True, speculative_tokens=k, speculative_ngram_min=1, **more)


@given(st.integers(1, 16), st.lists(st.floats(0, 1), min_size=1, max_size=60))
def test_the_draft_length_follows_how_drafts_fare(k, fates):
    cfg, request = config(k), row()
    for fate in fates:
        limit = request.draft_limit or k
        draft = draft_for(request, cfg)
        if request.draft_pause or not draft:
            continue
        assert 1 <= len(draft) == limit <= k
        request.draft = draft
        accepted = round(fate * len(draft))
        drafted(request, accepted, cfg)
        if accepted == len(draft):
            assert request.draft_limit == k
        else:
            assert request.draft_limit == accepted + 1 <= len(draft)
        assert request.draft == ()


def test_repeated_misses_pause_drafting_then_it_resumes():
    cfg, request = config(), row()
    for _ in range(MAX_MISSES):
        request.draft = draft_for(request, cfg)
        assert request.draft
        drafted(request, 0, cfg)
    for _ in range(PAUSE_STEPS):
        assert draft_for(request, cfg) == ()
    assert draft_for(request, cfg) == (7,)  # back, one token long after the misses


def paused_for(request: Request, cfg: BatcherConfig) -> int:
    """Miss until the row pauses; the steps it then sits out."""
    for _ in range(MAX_MISSES):
        request.draft = draft_for(request, cfg)
        drafted(request, 0, cfg)
    steps = 0
    while draft_for(request, cfg) == ():
        steps += 1
    return steps


def test_each_pause_without_a_kept_token_is_twice_as_long_up_to_a_bound():
    cfg, request = config(), row()
    pauses = [paused_for(request, cfg) for _ in range(MAX_BACKOFF + 3)]
    assert pauses == [PAUSE_STEPS << min(i, MAX_BACKOFF) for i in range(MAX_BACKOFF + 3)]
    request.draft = draft_for(request, cfg)
    drafted(request, 1, cfg)  # a kept token: the next pause is the first one's length again
    assert paused_for(request, cfg) == PAUSE_STEPS


@given(st.integers(1, 30), st.integers(0, 30), st.integers(1, 16))
def test_no_draft_reaches_past_max_tokens(max_tokens, generated, k):
    request = row(max_tokens)
    request.output_ids.extend([7] * min(generated, max_tokens - 1))
    draft = draft_for(request, config(k))
    assert len(request.output_ids) + len(draft) + 1 <= max_tokens or not draft


def test_off_or_too_wide_drafts_nothing():
    rows = [row() for _ in range(3)]
    assert plan_drafts(rows, BatcherConfig(speculative=False)) == 0 and all(r.draft == () for r in rows)
    assert plan_drafts(rows, config(4, speculative_max_batch=2)) == 0
    assert plan_drafts(rows, config(4, speculative_max_batch=3)) == 3 and all(r.draft == (7,) for r in rows)
    assert plan_drafts(rows, config(11, speculative_max_batch=3)) == 9 and all(r.draft == (7,) * 3 for r in rows)
    # A step with prompts to prefill gives its positions to them.
    assert plan_drafts(rows, config(4), prompts_pending=True) == 0 and all(r.draft == () for r in rows)


@given(st.integers(1, 16), st.integers(1, 6))
def test_rows_drafting_together_share_one_rows_positions(k, rows):
    batch = [row() for _ in range(rows)]
    total = plan_drafts(batch, config(k, speculative_max_batch=6))
    share = k if rows == 1 else min(k, max(1, (k + 1) // rows - 1))
    assert all(r.draft == (7,) * share for r in batch) and total == rows * share


def test_only_the_rows_that_draft_share_and_a_pause_counts_every_step():
    paused, copying = row(), row()
    paused.draft_pause = 3
    assert plan_drafts([paused, copying], config(8)) == 8  # the paused row takes no share
    assert paused.draft == () and paused.draft_pause == 2
    plan_drafts([paused, copying], config(8, speculative_max_batch=1))  # too wide to draft: still a step
    assert paused.draft_pause == 1
    plan_drafts([paused], config(8), prompts_pending=True)
    assert paused.draft_pause == 0 and plan_drafts([paused], config(8)) == 8


class _Compiled:
    """A compiled grammar as the scheduler sees one: opaque."""

    spec = None


def test_a_row_whose_output_follows_a_grammar_never_drafts():
    # Verifying a drafted position of a constrained row needs the grammar's mask at that position: one more
    # mask per drafted token, on the worker, whether or not the draft is kept.
    constrained, free = row(), row()
    constrained.grammar = _Compiled()
    assert draft_for(constrained, config(8)) == ()
    assert plan_drafts([constrained, free], config(8)) == 8
    assert constrained.draft == () and free.draft == (7,) * 8
