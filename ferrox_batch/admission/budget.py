"""`ContextCeiling`: the per-request position ceiling, shared by every serving path of one model.

One instance per loaded model, shared by the batcher and the private decode
path, so its `refused` counter counts context refusals from both. It answers
three questions, in the order admission asks them (docs/upstream.md, ContextCeiling):

1. `prompt_refusal`: is the prompt alone at or past the ceiling? (refused)
2. `overflow_refusal`: does `prompt + max_tokens` overflow the position
   counter (`2**64 - 1`)? (refused, even with no ceiling configured)
3. otherwise `fit` clamps `max_tokens` down to what the ceiling leaves. A
   clamp is not a refusal and counts nothing.

`refusal(positions)` is the older (V2) whole-request check the block ledger asks
first in `BlockBudget.immovable_refusal`.

Refusals are *returned* (as upstream returns `Err`/`Some(err)`), not raised:
the caller decides whether to raise, reply or count. Every method that returns
a refusal has already moved the `refused` counter by exactly one; every other
outcome moves nothing. The counter is guarded by its own lock.
"""

from __future__ import annotations

import threading

from ferrox_batch.admission.kv import KvShape
from ferrox_batch.checks import UNLIMITED, check_int
from ferrox_batch.errors import CONTEXT_LENGTH_EXCEEDED, DecodeError, KvBudgetExceeded


class ContextCeiling:
    """`limit` positions per request (None = no ceiling), priced in bytes by `shape` for reports."""

    __slots__ = ("_limit", "_shape", "_refused", "_lock")

    def __init__(self, limit: int | None, shape: KvShape) -> None:
        if limit is not None:
            check_int("max_context", limit, minimum=1)
        if not isinstance(shape, KvShape):
            raise TypeError(f"shape must be a KvShape, got {shape!r}")
        self._limit = limit
        self._shape = shape
        self._refused = 0
        self._lock = threading.Lock()

    @property
    def shape(self) -> KvShape:
        return self._shape

    def limit(self) -> int | None:
        return self._limit

    def refused(self) -> int:
        """Requests this ceiling refused, from every serving path that shares it."""
        with self._lock:
            return self._refused

    def bytes_for(self, positions: int) -> int:
        """KV bytes for `positions` positions: a reporting number (saturating, never raises on range)."""
        return self._shape.kv_bytes_for_tokens(positions)

    def _count(self) -> None:
        with self._lock:
            self._refused += 1

    def prompt_refusal(self, prompt_tokens: int) -> KvBudgetExceeded | None:
        """Refuse a prompt at or past the ceiling (a prompt equal to it leaves no room to generate)."""
        check_int("prompt_tokens", prompt_tokens)
        limit = self._limit
        if limit is None or prompt_tokens < limit:
            return None
        self._count()
        # "> {limit}" even when equal: the wording is upstream's and clients match on it.
        return KvBudgetExceeded(
            binding=CONTEXT_LENGTH_EXCEEDED,
            estimated_bytes=self.bytes_for(prompt_tokens),
            limit_bytes=self.bytes_for(limit),
            positions=prompt_tokens,
            positions_limit=limit,
            detail=f"prompt is too long: {prompt_tokens} tokens > {limit} maximum",
        )

    def overflow_refusal(self, prompt_tokens: int, max_tokens: int) -> KvBudgetExceeded | None:
        """Refuse a `prompt + max_tokens` past `2**64 - 1` (Rust's usize overflow), ceiling or not."""
        check_int("prompt_tokens", prompt_tokens)
        check_int("max_tokens", max_tokens)
        if prompt_tokens + max_tokens <= UNLIMITED:
            return None
        self._count()
        return KvBudgetExceeded(
            binding=CONTEXT_LENGTH_EXCEEDED,
            estimated_bytes=0,
            limit_bytes=0,
            positions=UNLIMITED,
            positions_limit=UNLIMITED if self._limit is None else self._limit,
            detail=(
                f"prompt of {prompt_tokens} tokens plus max_tokens of {max_tokens} overflows the "
                "position counter, so this request cannot be served by any deployment. "
                "Send a max_tokens that fits the model's context"
            ),
        )

    def fit(self, prompt_tokens: int, max_tokens: int) -> int | DecodeError:
        """The `max_tokens` to serve with (clamped to the ceiling), or the refusal."""
        # Validate both before anything can count, so a bad argument never moves `refused`.
        check_int("prompt_tokens", prompt_tokens)
        check_int("max_tokens", max_tokens)
        refusal = self.prompt_refusal(prompt_tokens)
        if refusal is not None:
            return refusal
        refusal = self.overflow_refusal(prompt_tokens, max_tokens)
        if refusal is not None:
            return refusal
        limit = self._limit
        if limit is not None and prompt_tokens + max_tokens > limit:
            return limit - prompt_tokens
        return max_tokens

    def refusal(self, positions: int) -> KvBudgetExceeded | None:
        """Refuse a request needing more than `limit` positions in all (exactly at the limit fits)."""
        check_int("positions", positions)
        limit = self._limit
        if limit is None or positions <= limit:
            return None
        self._count()
        return KvBudgetExceeded(
            binding=CONTEXT_LENGTH_EXCEEDED,
            estimated_bytes=self.bytes_for(positions),
            limit_bytes=self.bytes_for(limit),
            positions=positions,
            positions_limit=limit,
            detail=(
                f"request asks for {positions} token positions (prompt + max_tokens) but this "
                f"deployment admits {limit} per request; shorten the prompt or lower max_tokens"
            ),
        )

    def __repr__(self) -> str:
        return f"ContextCeiling(limit={self._limit!r}, refused={self.refused()})"
