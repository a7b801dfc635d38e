"""How what a forward computed and sampled advances each request, one request at a time.

`Scheduler.update` calls these for every request of a forward. Each step is the request's own: a store
that disagrees with what the request believes it holds, or a token whose stop checks, detokenising or sink
raises, fails that request (`isolation`) and leaves every other request of the forward as it was.
"""

from __future__ import annotations

from ferrox_batch.errors import DecodeError
from ferrox_batch.forward import GrammarComplete, Sampled
from ferrox_batch.generation_types import FinishReason
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.scheduler.isolation import failure
from ferrox_batch.scheduler.leases import KvLeases
from ferrox_batch.scheduler.request import DecodeFn, Request


def computed(request: Request, tokens: int, kv: KvLeases) -> None:
    """Advance `request` by the `tokens` positions the forward computed for it. A store that disagrees fails
    the request: its KV is not what the scheduler believes, so nothing more may be computed on it."""
    assert request.seq_id is not None
    request.num_computed_tokens += tokens
    try:
        held = kv.length(request.seq_id)
    except Exception as bad:
        request.fail(failure("reading its KV length", bad))
        return
    if held != request.num_computed_tokens:
        request.fail(failure("checking its KV", RuntimeError(
            f"sequence {request.seq_id} believes {request.num_computed_tokens} tokens are cached "
            f"but the KV store holds {held}")))


def sampled(request: Request, outcome: Sampled, decode: DecodeFn) -> None:
    """Apply one sampled outcome to a request still going: a token (stop checks, text, length; complete
    when it ends the request's grammar), or the error that ends it."""
    try:
        complete = isinstance(outcome, GrammarComplete)
        token = outcome.token if isinstance(outcome, GrammarComplete) else outcome
        if isinstance(token, DecodeError):
            request.fail(token)
        elif isinstance(token, TokenLogprob):
            request.push_token(token.token, decode, token)
        else:
            request.push_token(token, decode)
        if complete and request.going:  # the output is a whole sentence of its grammar
            request.finish = FinishReason.STOP
    except Exception as bad:
        request.fail(failure("applying its sampled token", bad))
