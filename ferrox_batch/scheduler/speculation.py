"""Which decoding rows draft this step, and how much (speculative decoding by prompt lookup).

A row drafts when speculation is on (`BatcherConfig.speculative_tokens` > 0), the step is small (at most
`speculative_max_batch` decoding rows: a full batch is compute-bound, and drafts would cost it throughput),
its lease keeps every position (a sliding lease recycles pages a rejected draft could have written), and
its recent drafts were not all rejected (`MAX_MISSES` in a row stop its drafting). Its draft is the n-gram
lookup of `ngram_draft`, capped so that the draft and the token after it stay within `max_tokens`: every
position a drafted row's forward writes is then inside what admission priced for it.

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

#: Consecutive drafts a row may have entirely rejected before it stops drafting.
MAX_MISSES = 8


def plan_drafts(decodes: Sequence[Request], config: BatcherConfig) -> int:
    """Set each decoding row's `draft` for this step (rows keep none between steps: `drafted` clears it);
    the draft tokens in all. Costs nothing when speculation is off or the batch is too wide."""
    if config.speculative_tokens == 0:
        return 0
    if len(decodes) > config.speculative_max_batch:
        for request in decodes:
            request.draft = ()
        return 0
    total = 0
    for request in decodes:
        request.draft = draft_for(request, config)
        total += len(request.draft)
    return total


def draft_for(request: Request, config: BatcherConfig) -> tuple[int, ...]:
    if request.window is not None or request.draft_misses >= MAX_MISSES:
        return ()
    room = request.params.max_tokens - len(request.output_ids) - 1  # the draft, then one more token
    k = min(config.speculative_tokens, room)
    if k <= 0:
        return ()
    index = request.ngram
    if index is None:
        index = request.ngram = NgramIndex(config.speculative_ngram_min, config.speculative_ngram_max,
                                           request.prefill_tokens)
    # Only the tokens generated since the last draft are new to the index (no copy of the sequence).
    index.extend(request.output_ids[len(index) - len(request.prefill_tokens):])
    return tuple(index.draft(k))


def drafted(request: Request, accepted: int) -> None:
    """Account a verified draft: `accepted` of its tokens were kept."""
    request.draft_misses = 0 if accepted else request.draft_misses + 1
    request.draft = ()
