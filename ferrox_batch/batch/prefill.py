"""A resumable, chunked prompt prefill (`PrefillState`) and an admitted request still prefilling (`Prefill`).

The worker runs at most one prefill chunk per tick, inside the same forward as
every decoding row's next token, so a long prompt never freezes the decodes
(spec invariant 8). `PrefillState` only decides *which* tokens the next chunk
holds and advances once the forward that ran them returned; the position
cursor is the KV store's length (spec invariant 12), checked on every advance.

An empty prompt prefills one stand-in token (`0`): a forward is still needed
to get the logits the first sampled token comes from.
"""

from __future__ import annotations

import queue
from collections import deque
from dataclasses import dataclass

import torch

from ferrox_batch.batch.clock import RowClock
from ferrox_batch.batch.config import BatcherConfig
from ferrox_batch.batch.row import Slot
from ferrox_batch.batch.step_budget import prefill_budget
from ferrox_batch.checks import check_int
from ferrox_batch.generation_types import GenerationParams
from ferrox_batch.models.batch_inputs import SeqChunk
from ferrox_batch.models.paged_kv import PagedKvStore
from ferrox_batch.policy.stop import StopMatcher
from ferrox_batch.stop_tokens import StopTokens


class PrefillState:
    __slots__ = ("seq_id", "tokens", "_processed", "_chunk_size")

    def __init__(self, seq_id: int, prompt: list[int], chunk_size: int, processed: int = 0) -> None:
        check_int("chunk_size", chunk_size, minimum=1)
        self.seq_id = seq_id
        self.tokens = list(prompt) if prompt else [0]
        if not 0 <= processed < len(self.tokens):
            raise ValueError(f"a prefill cannot start at {processed} of {len(self.tokens)} tokens")
        self._processed = processed
        self._chunk_size = chunk_size

    def tokens_processed(self) -> int:
        return self._processed

    def tokens_remaining(self) -> int:
        return len(self.tokens) - self._processed

    def is_done(self) -> bool:
        return self._processed >= len(self.tokens)

    def chunk_ceiling(self) -> int:
        return self._chunk_size

    def next_chunk(self, budget: int) -> list[int]:
        """The tokens the next forward should run: at most `budget` (V4: the tick's prefill budget)."""
        check_int("budget", budget, minimum=1)
        return self.tokens[self._processed:self._processed + budget]

    def advance(self, count: int, kv_length: int) -> bool:
        """Record that a forward ran `count` tokens; `kv_length` is the store's length after it."""
        self._processed += count
        if kv_length != self._processed:
            raise RuntimeError(
                f"prefill of sequence {self.seq_id} believes {self._processed} tokens are cached "
                f"but the KV store holds {kv_length}"
            )
        return self.is_done()

    def step_chunk(self, decoder, store: PagedKvStore, budget: int | None = None) -> tuple[bool, torch.Tensor | None]:
        """Run the next chunk alone (tests and single-request use); returns (done, last logits or None)."""
        if self.is_done():
            return True, None
        chunk = self.next_chunk(budget or self._chunk_size)
        logits = decoder.forward([SeqChunk(self.seq_id, chunk)], store)
        return self.advance(len(chunk), store.seq_len(self.seq_id)), logits[0]


@dataclass(slots=True)
class Prefill:
    state: PrefillState
    prompt_tokens: int  # real prompt length (0 for an empty prompt)
    params: GenerationParams
    stop_tokens: StopTokens
    reply: queue.SimpleQueue
    abort: int
    blocks: int
    clock: RowClock

    def into_slot(self, sampler_row: object) -> Slot:
        self.clock.prefill_finished()
        return Slot(
            seq_id=self.state.seq_id,
            sampler=sampler_row,
            prompt_tokens=self.prompt_tokens,
            max_tokens=self.params.max_tokens,
            stop_tokens=self.stop_tokens,
            params=self.params,
            reply=self.reply,
            abort=self.abort,
            blocks=self.blocks,
            clock=self.clock,
            stops=StopMatcher(self.params.stop, self.params.stop_token_ids),
        )


def take_prefill_chunks(
    prefills: deque[Prefill], config: BatcherConfig, decode_rows: int, tick_tokens: int | None = None
) -> list[tuple[Prefill, list[int]]]:
    """The prompts one tick advances, taken off the front of `prefills`, and the tokens of each.

    `tick_tokens` is the tick's token budget: `config.max_batch_tokens` unless given (the step
    target lowers it). The first prompt gets `prefill_budget(...)` tokens (at least
    MIN_PREFILL_CHUNK, so a saturated batch still progresses: the V4 step budget); with
    `max_prefills_per_tick > 1` further prompts share what is left of the budget, each at most
    its chunk ceiling. The caller puts back every prompt that is not finished: at the back with one
    prompt a tick (the upstream round-robin), at the front with several (first come, first finished).
    """
    taken: list[tuple[Prefill, list[int]]] = []
    if not prefills:
        return taken
    budget_tokens = config.max_batch_tokens if tick_tokens is None else tick_tokens
    first = prefills.popleft()
    budget = prefill_budget(budget_tokens, decode_rows, first.state.chunk_ceiling())
    chunk = first.state.next_chunk(budget)
    taken.append((first, chunk))
    left = budget_tokens - decode_rows - len(chunk)
    while prefills and len(taken) < config.max_prefills_per_tick and left > 0:
        prefill = prefills.popleft()
        chunk = prefill.state.next_chunk(min(left, prefill.state.chunk_ceiling()))
        taken.append((prefill, chunk))
        left -= len(chunk)
    return taken
