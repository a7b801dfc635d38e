"""How many prompt tokens one tick may prefill, given how many rows decode in it.

A tick runs one bounded prefill chunk and then one decode step over every
in-flight row. With a constant chunk the work of a tick was `chunk + rows`,
growing with the batch, and every decoding row waits for the whole chunk
before its next token: admitting one prompt raised inter-token latency for
everybody already answering. The quantity to bound is the *sum*, so the
chunk takes what is left of a per-tick token budget (`max_batch_tokens`)
after the decode width, never more than the configured chunk.

A budget alone deadlocks: once enough rows decode, nothing is left, no prompt
advances, and the rows that would free the budget wait on prompts that never
run. `MIN_PREFILL_CHUNK` is the floor that makes progress unconditional, so
the budget is a target, not a cap: a batch wider than the budget costs
`rows + MIN_PREFILL_CHUNK`. The floor also wins over a configured chunk below
it (upstream behaviour, kept: `prefill_chunk = 1` behaves as 16; docs/upstream.md Q1).
"""

from __future__ import annotations

from ferrox_batch.admission.config import DEFAULT_MAX_BATCH_TOKENS
from ferrox_batch.checks import check_int

__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "MIN_PREFILL_CHUNK", "prefill_budget"]

MIN_PREFILL_CHUNK = 16
"""The smallest prefill chunk a tick runs, however wide the batch."""


def prefill_budget(max_batch_tokens: int, decode_rows: int, configured_chunk: int) -> int:
    """Prompt tokens this tick may run:
    `clamp(max(0, max_batch_tokens - decode_rows), MIN_PREFILL_CHUNK,
    max(configured_chunk, MIN_PREFILL_CHUNK))`."""
    max_batch_tokens = check_int("max_batch_tokens", max_batch_tokens)
    decode_rows = check_int("decode_rows", decode_rows)
    configured_chunk = check_int("configured_chunk", configured_chunk)
    left = max(0, max_batch_tokens - decode_rows)
    # The floor is applied after the ceiling so that a ceiling below the
    # floor yields the floor (Rust's `clamp` would panic there; upstream
    # raises the ceiling to the floor first, which is the same thing).
    return max(MIN_PREFILL_CHUNK, min(left, max(configured_chunk, MIN_PREFILL_CHUNK)))
