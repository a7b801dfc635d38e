"""Which decoding rows draft this step, and how much (speculative decoding by prompt lookup).

A row drafts when speculation is on (`BatcherConfig.speculative`), the step is small (at most
`speculative_max_batch` decoding rows: a full batch is compute-bound, and drafts would cost it throughput)
and has no prompt to prefill (its positions go to the prompts), and its lease keeps every position (a
sliding lease recycles pages a rejected draft could have written), and its output follows no grammar
(verifying a constrained row's drafted position needs the grammar's mask there: one more mask per drafted
token on the worker, kept or not, where the row without a draft computes one per token). Its draft is the n-gram lookup of
`ngram_draft`, capped so that the draft and the token after it stay within `max_tokens`: every position a
drafted row's forward writes is then inside what admission priced for it. The rows that draft in one step
share what one row may draft (`speculative_tokens` + 1 positions, each row at least one draft token).

How long a row's drafts are adapts to how they fare, since each drafted position costs a share of a
step whether or not it is kept: a draft kept whole lets the next be as long as allowed
(`speculative_tokens`: the row is copying), a draft whose first `a` tokens were kept makes the next `a + 1`
long (the runs it copies are about that long), and a draft rejected whole makes the next one token long.
Replaying the answers of the copying benchmark's tasks under a step-cost model measured on the default
model, these rules kept the most tokens per second of those tried (doubling after a whole draft, or keeping
the length after a cut, did 5-10% worse: `scripts/bench_draft_policy.py`). A row whose `MAX_MISSES` drafts
in a row were rejected whole stops drafting for `PAUSE_STEPS` steps, then tries again (an answer may start
copying only after it has said something of its own); a row that keeps missing pauses twice as long each
time, until it keeps a token (a model that copies nothing, as one with random weights, then spends almost
no steps on drafts).

The runner verifies a draft by sampling its positions in order, each with the row's own sampler state,
and keeps the prefix the samples agree with plus the first sample that disagrees (`runtime.runner`).
Since a draft is a fixed guess, accepting it exactly where the model's own sample equals it is the
speculative acceptance rule: the output is the one the row would have produced without speculation,
seeds and penalties included.
"""

from __future__ import annotations

from collections.abc import Sequence

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.scheduler.ngram_draft import NgramIndex
from ferrox_batch.scheduler.request import Request

#: Consecutive drafts a row may have entirely rejected before it pauses drafting, and for how many steps;
#: each pause with no token kept since the last one is twice as long, up to `2**MAX_BACKOFF` times.
MAX_MISSES = 4
PAUSE_STEPS = 16
MAX_BACKOFF = 4


def plan_drafts(decodes: Sequence[Request], config: BatcherConfig, prompts_pending: bool = False) -> int:
    """Set each decoding row's `draft` for this step (rows keep none between steps: `drafted` clears it);
    the draft tokens in all. Costs nothing when speculation is off. No row drafts when the batch is too
    wide or `prompts_pending` (admitted prompts still to prefill: the step's positions go to them first, as
    a drafted position costs what a prompt token does and would delay their first tokens)."""
    if not config.speculative:
        return 0
    if len(decodes) > config.speculative_max_batch or prompts_pending:
        for request in decodes:
            request.draft = ()
            if request.draft_pause:  # a pause is counted in steps, whether or not the step could draft
                request.draft_pause -= 1
        return 0
    for request in decodes:
        request.draft = draft_for(request, config)
    # The rows that draft share one step's worth of drafted positions (what one row may draft alone), each
    # keeping the start of its draft: a drafted position costs the same whichever row it is in. Four copying
    # rows at once measured the same tokens per second sharing as each drafting up to the whole, with steps
    # short enough that the gap between two of a row's tokens had half the tail (docs/benchmarks.md).
    drafting = [request for request in decodes if request.draft]
    if len(drafting) > 1:
        share = max(1, (config.speculative_tokens + 1) // len(drafting) - 1)
        for request in drafting:
            request.draft = request.draft[:share]
    return sum(len(request.draft) for request in drafting)


def draft_for(request: Request, config: BatcherConfig) -> tuple[int, ...]:
    """The row's draft for this step, were it the only row drafting: at most its current draft length and
    what `max_tokens` leaves room for; () while it sits out a pause (counting it down)."""
    if request.window is not None or request.grammar is not None:
        return ()
    if request.draft_pause:
        request.draft_pause -= 1
        return ()
    room = request.params.max_tokens - len(request.output_ids) - 1  # the draft, then one more token
    k = min(request.draft_limit or config.speculative_tokens, room)
    if k <= 0:
        return ()
    index = request.ngram
    if index is None:
        index = request.ngram = NgramIndex(config.speculative_ngram_min, config.speculative_ngram_max,
                                           request.prefill_tokens)
    # Only the tokens generated since the last draft are new to the index (no copy of the sequence).
    index.extend(request.output_ids[len(index) - len(request.prefill_tokens):])
    return tuple(index.draft(k))


def drafted(request: Request, accepted: int, config: BatcherConfig) -> None:
    """Account a verified draft: `accepted` of its tokens were kept (module docstring: the next draft's
    length, and the pause after repeated misses)."""
    if accepted == len(request.draft):
        request.draft_limit = config.speculative_tokens
    else:
        request.draft_limit = min(config.speculative_tokens, accepted + 1)
    if accepted:
        request.draft_misses = request.draft_pauses = 0
    else:
        request.draft_misses += 1
    if request.draft_misses >= MAX_MISSES:
        request.draft_misses = 0
        request.draft_pause = PAUSE_STEPS << min(request.draft_pauses, MAX_BACKOFF)
        request.draft_pauses += 1
    request.draft = ()
