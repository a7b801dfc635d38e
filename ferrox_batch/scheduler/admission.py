"""Admission's two decisions, as functions of the scheduler's state: which waiting request goes next, and
what admitting it takes.

* `pick`: the head of the waiting queue, or with the prefix cache the request with the deepest cached
  prefix among the first `WINDOW` of the head's priority, within `cache_aware.choose`'s starvation bounds
  (a cold cache is exactly FIFO). A request that follows a prompt not yet through (`Request.after`) is
  passed over until it is, without holding anybody up.
* `accept`: the vocabulary checks the handle already made on the caller's thread, again (a request built
  by hand must not reach the store with an id outside the vocabulary),
  the answer a request gets without running (`max_tokens=0` and nothing to score), and its KV lease, which
  adopts the cached prefix; on success the request is admitted, its computed tokens starting after what
  it adopted.

* `reservation`: the blocks admitting a request reserves, after what it adopts from the prefix cache.

Whatever one of these raises for a request is that request's failure (`isolation`), returned as its
answer, never raised. The scheduler owns the loop around them (`Scheduler._admit`): the block reservation,
the head holding the line, the skip counters and the queue slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ferrox_batch.admission.cache_aware import WINDOW, choose
from ferrox_batch.admission.counters import Counters
from ferrox_batch.errors import DecodeError, InvalidRequest, TokenOutOfVocab
from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.prompt_logprobs import PromptLogprobs
from ferrox_batch.scheduler.isolation import failure
from ferrox_batch.scheduler.leases import KvLeases
from ferrox_batch.scheduler.request import Request
from ferrox_batch.scheduler.waiting import WaitingQueue
from ferrox_batch.usage import Usage


def pick(waiting: WaitingQueue, prefilling: Sequence[Request], kv: KvLeases,
         prefix_cache: bool) -> tuple[Request | None, list[Request], int]:
    """The request to admit (None when every waiting one is held back), the window it was chosen from and
    its place there (the ones before it were passed over)."""
    held = None
    if waiting.followers:
        computing = {r.abort for r in waiting} | {r.abort for r in prefilling}
        held = lambda r: r.after in computing  # noqa: E731
    window = waiting.window(WINDOW if prefix_cache else 1, held)
    if len(window) < 2:
        return (window[0] if window else None), [], 0
    index = choose([_depth(kv, r) for r in window], [r.skips for r in window])
    return window[index], window, index


def _depth(kv: KvLeases, request: Request) -> int:
    """Cached blocks `request` would adopt; 0 when looking it up raises, which the request's own admission
    then answers (it looks again, and fails alone)."""
    try:
        return kv.peek(request.cacheable_tokens, request.params.cache_salt)[0]
    except Exception:
        return 0


def reservation(request: Request, kv: KvLeases) -> int | DecodeError:
    """Blocks admitting `request` reserves now, or the failure of looking up its cached prefix (its own).

    Adopted blocks cost the ledger nothing when another lease already references them, and one each when
    they sit unreferenced in the cache (reclaimable, so counted as free)."""
    try:
        adopted, unreferenced = kv.peek(request.cacheable_tokens, request.params.cache_salt)
    except Exception as bad:
        return failure("looking up its cached prefix", bad)
    return request.blocks - adopted + unreferenced


def accept(request: Request, kv: KvLeases, vocab_size: int, clock: Callable[[], float],
           cache_counters: Counters | None) -> GenerationResult | DecodeError | None:
    """Lease the request's KV and start it (None); or the answer it gets at once. `cache_counters`: where
    prefix-cache lookups are counted, None when there is no cache. A step that raises is this request's
    failure alone: a lease it made is ended, and it is answered with the error."""
    try:
        return _accept(request, kv, vocab_size, clock, cache_counters)
    except Exception as bad:
        if request.seq_id is not None:
            try:
                kv.release(request.seq_id)
            except Exception as lost:
                failure("ending the lease of a request that failed admission", lost)
            request.seq_id = None
        return failure("admitting it", bad)


def _accept(request: Request, kv: KvLeases, vocab_size: int, clock: Callable[[], float],
            cache_counters: Counters | None) -> GenerationResult | DecodeError | None:
    bad = next((t for t in request.prompt_tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        return TokenOutOfVocab(bad, vocab_size)
    biased = next((t for t, _ in request.params.sampling.logit_bias if t >= vocab_size), None)
    if biased is not None:
        return InvalidRequest("logit_bias", biased, f"names a token id outside the model's vocabulary of {vocab_size}")
    if request.params.max_tokens == 0 and request.params.prompt_logprobs is None and request.params.pooling is None:
        # The upstream never finishes such a request; here it ends at once (unless it scores its
        # prompt: then it runs the prompt and stops).
        return GenerationResult(FinishReason.LENGTH, [], "", Usage.new(len(request.prompt_tokens), 0),
                                None if request.params.logprobs is None else ())
    stops = request.stops if request.stops is not None else request.stop_matcher()
    try:
        seq_id = kv.allocate(request.positions, request.cacheable_tokens, request.params.cache_salt,
                             request.window, every=len(request.prompt_tokens) + request.params.max_tokens)
    except DecodeError as refused:
        return refused
    request.admitted(seq_id, clock, stops)
    if request.params.prompt_logprobs is not None:
        # Nothing predicts the first token; the others' entries come as arrays, chunk by chunk.
        request.prompt_logprobs = PromptLogprobs(request.params.prompt_logprobs, leading=1)
    request.num_computed_tokens = adopted = kv.length(seq_id)
    if cache_counters is not None:
        request.cached_tokens = min(adopted, len(request.prompt_tokens))
        cache_counters.add_prefix_lookup(len(request.prompt_tokens), request.cached_tokens)
    return None
