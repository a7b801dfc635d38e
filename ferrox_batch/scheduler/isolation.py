"""One request's failure is that request's alone.

The worker runs many requests' work in one loop: looking up a prompt's cached prefix, leasing its KV,
counting what a forward computed, applying a sampled token (stop tokens and strings, detokenising,
streaming to its sink), publishing its blocks and replying. Anything a request carries that makes one of
those steps raise must end that request, with an error naming the step, and never the loop: the request
is then answered and everything it holds returned by the scheduler's usual exits.

`failure` is the one place that policy is written down: the scheduler catches what each per-request step
raises and ends that request with `failure(step, error)`. What cannot be pinned on one request (the
forward itself, a broken invariant) is the worker's to handle (`engine.worker`).
"""

from __future__ import annotations

import logging

from ferrox_batch.errors import DecodeError, InternalError

log = logging.getLogger("ferrox_batch.scheduler")


def failure(step: str, error: Exception) -> DecodeError:
    """The error a request gets when `step` raised `error` while serving it: a typed refusal passes as it
    is; anything else is logged with its traceback and becomes an `InternalError` naming the step."""
    if isinstance(error, DecodeError):
        return error
    log.error("%s failed for one request; that request fails, the rest go on", step, exc_info=error)
    return InternalError(f"{step} failed: {type(error).__name__}: {error}")
