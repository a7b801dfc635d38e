"""`Counters` and `BatcherStats`: what the scheduler did, for operators and tests.

`Counters` is written by the worker and read by anyone; each method holds the
object's own lock, so readers on other threads see consistent numbers without
relying on the GIL. `BatcherStats` is the plain snapshot `stats()` returns,
assembled from the counters, the queue gate, the block ledger, the context
ceiling and the abort inbox (docs/upstream.md, Counters).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

from ferrox_batch.checks import check_int


class Counters:
    """Prefill chunks and tokens, decode forwards, and the peak blocks held by in-flight work."""

    __slots__ = ("_prefill_chunks", "_prefill_tokens", "_decode_steps", "_peak_blocks", "_prefix_queries",
                 "_prefix_hits", "_drafts", "_draft_tokens", "_accepted_tokens", "_accepted_per_pos", "_lock")

    def __init__(self) -> None:
        self._prefill_chunks = 0
        self._prefill_tokens = 0
        self._decode_steps = 0
        self._peak_blocks = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._drafts = 0
        self._draft_tokens = 0
        self._accepted_tokens = 0
        self._accepted_per_pos: list[int] = []  # by draft position: how many drafts kept that position
        self._lock = threading.Lock()

    def add_prefix_lookup(self, queried: int, hits: int) -> None:
        """One admitted prompt looked up in the prefix cache (port-only): `queried` prompt tokens, of which
        `hits` were adopted instead of computed (vLLM's `prefix_cache_queries` / `prefix_cache_hits`)."""
        check_int("queried", queried)
        check_int("hits", hits, maximum=queried)
        with self._lock:
            self._prefix_queries += queried
            self._prefix_hits += hits

    def prefix_cache(self) -> tuple[int, int]:
        """`(queried tokens, hit tokens)` since start."""
        with self._lock:
            return self._prefix_queries, self._prefix_hits

    def add_draft(self, tokens: int, accepted: int) -> None:
        """One verified draft (speculative decoding, port-only): `tokens` drafted, `accepted` of them kept
        (vLLM's `spec_decode_num_drafts` / `_num_draft_tokens` / `_num_accepted_tokens`). A draft is kept
        as a prefix, so positions 0 to `accepted - 1` each count one acceptance (`_per_pos`)."""
        check_int("tokens", tokens)
        check_int("accepted", accepted, maximum=tokens)
        with self._lock:
            self._drafts += 1
            self._draft_tokens += tokens
            self._accepted_tokens += accepted
            if len(self._accepted_per_pos) < tokens:
                self._accepted_per_pos.extend([0] * (tokens - len(self._accepted_per_pos)))
            for position in range(accepted):
                self._accepted_per_pos[position] += 1

    def speculation(self) -> tuple[int, int, int, tuple[int, ...]]:
        """`(drafts, draft tokens, accepted tokens, accepted tokens by draft position)` since start; the
        positions run to the longest draft seen."""
        with self._lock:
            return self._drafts, self._draft_tokens, self._accepted_tokens, tuple(self._accepted_per_pos)

    def add_prefill(self, tokens: int) -> None:
        """One `step_chunk` call that advanced `tokens` prompt tokens (adopted prefix positions excluded)."""
        check_int("tokens", tokens)
        with self._lock:
            self._prefill_chunks += 1
            self._prefill_tokens += tokens

    def add_decode_step(self) -> None:
        """One batched forward over a non-empty active set, whatever its width."""
        with self._lock:
            self._decode_steps += 1

    def record_peak(self, blocks: int) -> None:
        """Raise the high-water mark to `blocks` (measured from rows and prefills, not the ledger)."""
        check_int("blocks", blocks)
        with self._lock:
            if blocks > self._peak_blocks:
                self._peak_blocks = blocks

    def prefill_chunks(self) -> int:
        with self._lock:
            return self._prefill_chunks

    def prefill_tokens(self) -> int:
        with self._lock:
            return self._prefill_tokens

    def decode_steps(self) -> int:
        with self._lock:
            return self._decode_steps

    def peak_blocks(self) -> int:
        with self._lock:
            return self._peak_blocks

    def snapshot(self) -> tuple[int, int, int, int]:
        """`(prefill_chunks, prefill_tokens, decode_steps, peak_blocks)`, read together."""
        with self._lock:
            return (self._prefill_chunks, self._prefill_tokens, self._decode_steps, self._peak_blocks)

    def __repr__(self) -> str:
        chunks, tokens, steps, peak = self.snapshot()
        return f"Counters(prefill_chunks={chunks}, prefill_tokens={tokens}, decode_steps={steps}, peak_blocks={peak})"


@dataclass(frozen=True, slots=True)
class BatcherStats:
    """A serialisable snapshot of the batcher: the upstream fields plus `max_batch_tokens` and `worker_alive`.

    `max_seqs` is 0 when unlimited (never the sentinel); `kv_blocks_total` and
    `kv_blocks_free` are 0 when there is no block budget.
    """

    prefill_chunks: int
    prefill_tokens: int
    decode_steps: int
    queue_depth: int
    queue_rejected: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_block_size: int
    kv_rejected_too_large: int
    kv_rejected_context_length: int
    kv_blocks_peak: int
    aborted: int
    max_seqs: int
    prefill_chunk: int
    max_batch_tokens: int
    worker_alive: bool
    #: Port-only: the prefix cache's lookups and hits, in prompt tokens, and the blocks it holds now.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_blocks_cached: int = 0
    #: Port-only: the worker thread's time since start, in milliseconds (`engine.worker_time`).
    worker_idle_ms: int = 0
    worker_scheduling_ms: int = 0
    worker_forward_ms: int = 0
    worker_forward_off_cpu_ms: int = 0
    #: Port-only: the blocks the KV groups of global layers (every position) and of local layers (a
    #: sliding window) reference now; a model of one kind of layer has only one of them.
    kv_blocks_global: int = 0
    kv_blocks_local: int = 0
    #: Port-only: speculative decoding's verified drafts, their tokens, and the tokens accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    #: By draft position (0 = a draft's first token): the drafts that kept it.
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "worker_alive":
                if not isinstance(value, bool):
                    raise TypeError(f"worker_alive must be a bool, got {value!r}")
            elif f.name == "spec_decode_num_accepted_tokens_per_pos":
                if not isinstance(value, tuple):
                    raise TypeError(f"{f.name} must be a tuple, got {value!r}")
                for position, count in enumerate(value):
                    check_int(f"{f.name}[{position}]", count)
            else:
                check_int(f.name, value)

    def to_dict(self) -> dict[str, Any]:
        """JSON's types: the per-position counts as a list."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}
