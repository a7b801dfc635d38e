"""What the handle sends (`Job`), what a decoding request is (`Slot`), and the worker's table of them (`Rows`).

`Rows` keys every decoding request by a `Uid` that is never reused, so
removing one row can never redirect another row's sampler, stop matcher or
reply (spec invariant 5). `flush_finished` is the one exit every decoding row
takes (finished, stopped, length, cancelled, failed): it frees the row's KV
lease, returns its blocks to the ledger and sends its one `Finished` reply.
"""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ferrox_batch.batch.block_budget import BlockBudget
from ferrox_batch.batch.clock import RowClock
from ferrox_batch.batch.config import Chunk, Finished
from ferrox_batch.errors import DecodeError, InternalError
from ferrox_batch.generation_types import FinishReason, GenerationParams, GenerationResult
from ferrox_batch.policy.stop import Matched, StopMatcher
from ferrox_batch.policy.utf8_stream import Utf8Stream
from ferrox_batch.stop_tokens import StopTokens

Uid = int
log = logging.getLogger("ferrox_batch.batch")


@dataclass(slots=True)
class Job:
    prompt_tokens: list[int]
    params: GenerationParams
    stop_tokens: StopTokens
    reply: queue.SimpleQueue
    abort: int
    blocks: int
    positions: int  # KV positions the lease holds: what `blocks` was priced from


def send_finished(reply: queue.SimpleQueue, result: GenerationResult | DecodeError) -> None:
    reply.put(Finished(result))


@dataclass(slots=True)
class Slot:
    """One decoding request. Its KV lives in the store under `seq_id`; its next position is the store's length."""

    seq_id: int
    sampler: object  # the sampler's per-row state (models.sampler.RowSampler)
    prompt_tokens: int  # real prompt length for usage (0 for an empty prompt)
    max_tokens: int
    stop_tokens: StopTokens
    params: GenerationParams
    reply: queue.SimpleQueue
    abort: int
    blocks: int
    clock: RowClock
    stops: StopMatcher
    utf8: Utf8Stream = field(default_factory=Utf8Stream)
    generated_ids: list[int] = field(default_factory=list)
    visible: list[str] = field(default_factory=list)
    finish: FinishReason | None = None
    error: DecodeError | None = None

    def fail(self, error: DecodeError) -> None:
        """Stop the row with an error; it leaves through the normal flush, which replies with the error."""
        self.finish = FinishReason.STOP
        self.error = error

    def emit(self, text: str) -> None:
        if text:
            self.visible.append(text)
            self.reply.put(Chunk(text))

    def apply_stop_buffer(self, piece: str) -> bool:
        """Feed decoded text to the stop matcher; True when a stop string matched (the row is finished)."""
        step = self.stops.push(piece)
        self.emit(step.text)
        if isinstance(step, Matched):
            self.finish = FinishReason.stop_sequence(step.stop)
            return True
        return False

    def push_token(self, token: int, decode: Callable[[list[int]], bytes]) -> bool:
        """Apply one sampled token; True when the row goes on (the token must be fed to the model).

        A stop token ends the row and is not part of the output; a decoder failure fails this
        row only (`InternalError`), never the worker.
        """
        if (not self.params.ignore_eos and token in self.stop_tokens) or self.stops.is_stop_token(token):
            self.finish = FinishReason.STOP
            return False
        self.generated_ids.append(token)
        self.clock.token()
        try:
            text = decode([token])
        except Exception as bad:  # one row's detokenizer failure is that row's fault, not the worker's
            log.exception("decode failed")
            self.fail(InternalError(f"decoding token {token} failed: {type(bad).__name__}: {bad}"))
            return False
        piece = self.utf8.push(text)
        if piece and self.apply_stop_buffer(piece):
            return False
        if len(self.generated_ids) >= self.max_tokens:
            # The last token is not fed: its logits would be discarded (upstream feeds it anyway).
            self.finish = FinishReason.LENGTH
            return False
        return True

    def reply_finished(self) -> None:
        if self.error is not None:
            send_finished(self.reply, self.error)
            return
        if self.finish is None or self.finish.kind != "stop_sequence":
            # Divergence from upstream (spec 6.2): a character left incomplete at the end is
            # emitted as U+FFFD (through the stop matcher) instead of being dropped. After a
            # stop string matched, whatever followed the stop is dropped, as upstream.
            partial = self.utf8.flush()
            if partial:
                self.emit(self.stops.push(partial).text)
            self.emit(self.stops.flush())
        usage = self.clock.usage(self.prompt_tokens, len(self.generated_ids))
        finish = self.finish if self.finish is not None else FinishReason.STOP
        send_finished(self.reply, GenerationResult(finish, list(self.generated_ids), "".join(self.visible), usage))


class Rows:
    def __init__(self) -> None:
        self.state: dict[Uid, Slot] = {}
        self.order: list[Uid] = []
        self.next_uid: Uid = 0

    def insert(self, slot: Slot) -> Uid:
        uid = self.next_uid
        self.next_uid += 1
        self.state[uid] = slot
        self.order.append(uid)
        return uid

    def __len__(self) -> int:
        return len(self.order)

    def is_empty(self) -> bool:
        return not self.order

    def get(self, uid: Uid) -> Slot | None:
        return self.state.get(uid)

    def remove(self, uid: Uid) -> Slot | None:
        slot = self.state.pop(uid, None)
        if slot is not None:
            self.order.remove(uid)
        return slot

    def blocks_held(self) -> int:
        return sum(slot.blocks for slot in self.state.values())

    def mark_cancelled(self, ids: Iterable[int]) -> list[int]:
        """Mark unfinished rows whose abort id is in `ids` as Cancelled; return the ids consumed.

        Only marks: the row still leaves through `flush_finished`, which releases and replies.
        """
        wanted = set(ids)
        consumed = []
        for uid in self.order:
            slot = self.state[uid]
            if slot.abort in wanted and slot.finish is None:
                slot.finish = FinishReason.CANCELLED
                consumed.append(slot.abort)
        return consumed

    def ready(self) -> list[Uid]:
        return [
            uid for uid in self.order
            if self.state[uid].finish is None and len(self.state[uid].generated_ids) < self.state[uid].max_tokens
        ]

    def flush_finished(self, budget: BlockBudget, release_kv: Callable[[Slot], None]) -> int:
        """Remove every finished row: free its KV, return its blocks, reply once. Returns how many left."""
        done = [uid for uid in self.order if self.state[uid].finish is not None]
        for uid in done:
            slot = self.remove(uid)
            assert slot is not None
            release_kv(slot)
            budget.release(slot.blocks)
            slot.reply_finished()
        return len(done)
