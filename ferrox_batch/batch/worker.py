"""The worker thread: one loop that owns every in-flight request and drives the model (spec 2.13, V4).

Each tick: block only when fully idle -> drain the channel -> apply cancels
-> flush finished rows -> admit (FIFO; `max_seqs` and the block budget; a
head job that does not fit holds the line) -> record peak blocks -> sample
every ready row -> ONE forward holding every active row's next token *and*
one bounded prefill chunk (the V4 step budget; `max_prefills_per_tick` lets
further prompts share what is left of it; with `step_target_ms`, a tick with
rows decoding holds only the prompt tokens that keep it under that time, as
`step_cost` learns from every tick's measured time) -> flush.

Divergence from the upstream tick, on purpose: upstream runs the prefill
chunk as its own forward before sampling, then a second forward for the
decodes. Our runtime takes a mixed varlen batch, so both go in one forward:
the weights are read once per tick instead of twice. A prompt whose last
chunk ran in tick t samples its first token in tick t+1; every request's
tokens are unchanged.

Faults: an exception from the forward fails the requests that were in it
(`InternalError`), a bad sampler row fails that row; the worker keeps
serving. Anything else that escapes the tick is a scheduler bug: the worker
marks itself dead, answers every job it knows of and every job still on the
channel with `WorkerDied`, and returns every block and queue slot.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from typing import Callable, Sequence

import torch

from ferrox_batch.batch.block_budget import BlockBudget
from ferrox_batch.batch.clock import RowClock
from ferrox_batch.batch.config import BatcherConfig
from ferrox_batch.batch.counters import Counters
from ferrox_batch.batch.lifecycle import CLOSE, Lifecycle
from ferrox_batch.batch.prefill import Prefill, PrefillState, take_prefill_chunks
from ferrox_batch.batch.queue import AbortInbox, QueueGate
from ferrox_batch.batch.row import Job, Rows, Slot, send_finished
from ferrox_batch.batch.status import BatchStatus, PoolUsage, PrefillSnapshot, StatusReporter
from ferrox_batch.batch.step_cost import StepCostModel
from ferrox_batch.errors import (
    DecodeError,
    InternalError,
    KvAllocationFailed,
    KvPoolExhausted,
    TokenOutOfVocab,
    WorkerDied,
)
from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.models.batch_inputs import SeqChunk
from ferrox_batch.models.paged_kv import PagedKvStore
from ferrox_batch.usage import Usage

log = logging.getLogger("ferrox_batch.batch")

DecodeFn = Callable[[Sequence[int]], bytes]


class Worker:
    def __init__(
        self,
        *,
        decoder,
        decode: DecodeFn,
        config: BatcherConfig,
        jobs: queue.SimpleQueue,
        lifecycle: Lifecycle,
        counters: Counters,
        queue_gate: QueueGate,
        budget: BlockBudget,
        aborts: AbortInbox,
        store: PagedKvStore,
        sampler,
        log_interval: int,
    ) -> None:
        self.decoder = decoder
        self.decode = decode
        self.config = config
        self.jobs = jobs
        self.lifecycle = lifecycle
        self.counters = counters
        self.queue_gate = queue_gate
        self.budget = budget
        self.aborts = aborts
        self.store = store
        self.sampler = sampler
        self.vocab_size = decoder.vocab_size
        self.waiting: deque[Job] = deque()
        self.prefills: deque[Prefill] = deque()
        self.rows = Rows()
        self.carried: set[int] = set()
        self.in_forward: list[Prefill] = []  # prefills taken for the forward now running
        self.closing = False
        self.started = time.monotonic()
        self.reporter = StatusReporter(log_interval, 0.0)
        # What a tick costs here, learnt as it runs (the step target).
        self.step_cost = StepCostModel(asynchronous=store.device.type != "cpu")
        self._next_seq = 0
        # Logits of the last forward, and which of its rows belongs to which decoding row.
        self._logits: torch.Tensor | None = None
        self._logit_row: dict[int, int] = {}

    # ---------------------------------------------------------------- loop

    def run(self) -> None:
        try:
            while self.tick():
                pass
        except BaseException as crash:  # a scheduler bug: answer everyone, then stop
            log.exception("continuous-batch worker crashed")
            self.fail_everything(f"{type(crash).__name__}: {crash}")

    def tick(self) -> bool:
        """One scheduling step; False once the batcher is closed and idle."""
        if not self.rows.order and not self.prefills and not self.waiting:
            if self.closing:
                return False
            self._take(self.jobs.get())  # idle: block until there is work
        self._drain_channel()
        self._apply_aborts()
        self._flush()
        snapshot = self._admit()
        if snapshot.new_seqs:  # blocks are reserved only at admission: only then can the peak rise
            log.info(self.reporter.report_prefill(self._now(), snapshot, self.batch_status()))
            self.counters.record_peak(self.rows.blocks_held() + sum(p.blocks for p in self.prefills))
        began = time.perf_counter()
        active = self._sample_ready()
        prompt_tokens = self._forward(active)
        if self.config.step_target_ms is not None:
            self.step_cost.record(len(active), prompt_tokens, time.perf_counter() - began)
        self._flush()
        self._check_ledger()
        return True

    def _now(self) -> float:
        return time.monotonic() - self.started

    def _take(self, item: object) -> None:
        if item is CLOSE:
            self.closing = True
        else:
            self.waiting.append(item)  # type: ignore[arg-type]

    def _drain_channel(self) -> None:
        while True:
            try:
                self._take(self.jobs.get_nowait())
            except queue.Empty:
                return

    # ---------------------------------------------------------- cancellation

    def _apply_aborts(self) -> None:
        # A job is on the channel before its abort id can be (the cancel hook is registered after
        # the send), but the id may be drained first: an unmatched id is carried one tick, by which
        # time its job has been drained. An id still unmatched then belongs to a request that was
        # already answered (a cancel that raced its answer) and is dropped, so none pile up.
        fresh = self.aborts.drain()
        self.carried |= fresh
        if not self.carried:
            return
        stopped = 0
        for job in [j for j in self.waiting if j.abort in self.carried]:
            self.waiting.remove(job)
            self.carried.discard(job.abort)
            self.queue_gate.release()
            send_finished(job.reply, GenerationResult(FinishReason.CANCELLED, [], "", Usage.new(len(job.prompt_tokens), 0)))
            stopped += 1
        for prefill in [p for p in self.prefills if p.abort in self.carried]:
            self.prefills.remove(prefill)
            self.carried.discard(prefill.abort)
            self._release_prefill(prefill)
            send_finished(prefill.reply, GenerationResult(FinishReason.CANCELLED, [], "", Usage.new(prefill.prompt_tokens, 0)))
            stopped += 1
        consumed = self.rows.mark_cancelled(self.carried)
        self.carried.difference_update(consumed)
        self.carried &= fresh
        stopped += len(consumed)
        if stopped:
            self.aborts.add_aborted(stopped)

    # ------------------------------------------------------------- admission

    def _admit(self) -> PrefillSnapshot:
        new_seqs = new_tokens = 0
        while self.waiting and len(self.rows) + len(self.prefills) < self.config.max_seqs:
            job = self.waiting[0]
            if not self.budget.try_reserve(job.blocks):
                break  # the head holds the line: nothing smaller behind it is tried
            self.waiting.popleft()
            self.queue_gate.release()
            prefill = self._accept(job)
            if not isinstance(prefill, Prefill):
                # Refused at validation or finished at once: blocks go back before the reply,
                # so a caller that reads stats() after its answer sees them free.
                self.budget.release(job.blocks)
                send_finished(job.reply, prefill)
                continue
            self.prefills.append(prefill)
            new_seqs += 1
            new_tokens += len(job.prompt_tokens)
        return PrefillSnapshot(new_seqs, new_tokens, 0)

    def _accept(self, job: Job) -> Prefill | GenerationResult | DecodeError:
        """A prefill for an admitted job, or the job's whole answer when it ends here."""
        bad = next((t for t in job.prompt_tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return TokenOutOfVocab(bad, self.vocab_size)
        if job.params.max_tokens == 0:
            # Divergence (spec 6.1): upstream never finishes such a row; it ends at once here.
            return GenerationResult(FinishReason.LENGTH, [], "", Usage.new(len(job.prompt_tokens), 0))
        seq_id = self._next_seq
        while self.store.has_sequence(seq_id):  # a shared store may hold others' sequences
            seq_id += 1
        self._next_seq = seq_id + 1
        try:
            self.store.add_sequence(seq_id, job.positions)
        except KvPoolExhausted:  # the ledger said yes but the page store said no
            return KvPoolExhausted()
        except (MemoryError, torch.OutOfMemoryError) as failed:
            log.warning("allocating KV for a request failed: %s", failed)
            return KvAllocationFailed(f"{type(failed).__name__}: {failed}")
        state = PrefillState(seq_id, job.prompt_tokens, self.config.prefill_chunk)
        return Prefill(state, len(job.prompt_tokens), job.params, job.stop_tokens, job.reply, job.abort,
                       job.blocks, RowClock.start())

    # ------------------------------------------------------------- sampling

    def _sample_ready(self) -> list[int]:
        """Sample one token for every ready row; return the uids that must be fed to the next forward."""
        ready = self.rows.ready()
        if not ready:
            return []
        slots = [self.rows.state[uid] for uid in ready]
        index = [self._logit_row[uid] for uid in ready]
        logits = self._logits
        assert logits is not None
        if index != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(index, device=logits.device))
        try:
            tokens = self.sampler.sample(logits, [slot.sampler for slot in slots])
        except Exception as bad:  # the sampler itself failed: fail the rows it was sampling
            log.exception("sampler failed")
            for slot in slots:
                slot.fail(InternalError(f"sampling failed: {type(bad).__name__}: {bad}"))
            return []
        active = []
        for uid, slot, token in zip(ready, slots, tokens):
            if isinstance(token, DecodeError):
                slot.fail(token)
            elif slot.push_token(token, self.decode):
                active.append(uid)
        return active

    # --------------------------------------------------------------- forward

    def _forward(self, active: list[int]) -> int | None:
        """Run the tick's forward; the prompt tokens it held, or None when none ran (nothing to do, or it failed)."""
        chunks = [SeqChunk(self.rows.state[uid].seq_id, [self.rows.state[uid].generated_ids[-1]]) for uid in active]
        tick_tokens = self.step_cost.tick_tokens(self.config.max_batch_tokens, len(active),
                                                 self.config.step_target_ms)
        prompt_chunks = take_prefill_chunks(self.prefills, self.config, len(active), tick_tokens)
        # Off the prefill queue until they are put back or become rows: a crash meanwhile must
        # still answer them (`fail_everything`).
        self.in_forward = [prefill for prefill, _ in prompt_chunks]
        chunks += [SeqChunk(prefill.state.seq_id, tokens) for prefill, tokens in prompt_chunks]
        if not chunks:
            return None
        try:
            logits = self.decoder.forward(chunks, self.store)
        except Exception as bad:
            log.exception("forward failed")
            error = InternalError(f"forward failed: {type(bad).__name__}: {bad}")
            for uid in active:
                self.rows.state[uid].fail(error)
            for prefill in self.in_forward:
                self._release_prefill(prefill)
                send_finished(prefill.reply, error)
            self.in_forward = []
            return None
        self._logits = logits
        self._logit_row = {uid: j for j, uid in enumerate(active)}
        if active:
            self.counters.add_decode_step()
            line = self.reporter.report_decode(self._now(), len(active), self.batch_status())
            if line is not None:
                log.info(line)
        unfinished: list[Prefill] = []
        for row, (prefill, tokens) in enumerate(prompt_chunks, start=len(active)):
            self.counters.add_prefill(len(tokens))
            self.in_forward.pop(0)  # handled in the order taken: this prefill
            if prefill.state.advance(len(tokens), self.store.seq_len(prefill.state.seq_id)):
                sampler_row = self.sampler.new_row(prefill.params.sampling, prefill.params.seed, prefill.state.tokens)
                uid = self.rows.insert(prefill.into_slot(sampler_row))
                self._logit_row[uid] = row
            else:
                unfinished.append(prefill)
        if self.config.max_prefills_per_tick == 1:
            self.prefills.extend(unfinished)  # the upstream tick: round-robin, back of the line
        else:
            # Several prompts share each tick, so none starves; the unfinished keep the front, in
            # arrival order, and each prompt joins the decode batch as early as it can (first come,
            # first finished). Round-robin under a step target spread every prompt over the whole
            # burst: all finished late together, and the decode batch filled late.
            self.prefills.extendleft(reversed(unfinished))
        return sum(len(tokens) for _, tokens in prompt_chunks)

    # ----------------------------------------------------------------- exits

    def _release_kv(self, slot: Slot) -> None:
        self.store.free_sequence(slot.seq_id)

    def _release_prefill(self, prefill: Prefill) -> None:
        self.store.free_sequence(prefill.state.seq_id)
        self.budget.release(prefill.blocks)

    def _flush(self) -> None:
        self.rows.flush_finished(self.budget, self._release_kv)

    def _check_ledger(self) -> None:
        """The ledger and the store never disagree: blocks our sequences lease == blocks reserved (with a budget).

        Only this worker's own sequences count: a shared store may lease pages to others too.
        """
        if self.budget.total is None:
            return
        reserved = self.budget.total - self.budget.free()
        own = [slot.seq_id for slot in self.rows.state.values()] + [p.state.seq_id for p in self.prefills]
        held = sum(len(self.store.seq(seq_id).blocks) for seq_id in own)
        if reserved != held:
            raise RuntimeError(f"block ledger says {reserved} blocks are reserved but the KV store leases {held}")

    def batch_status(self) -> BatchStatus:
        total = self.budget.total
        pages = PoolUsage.empty() if total is None else PoolUsage.from_available(total, self.budget.free())
        return BatchStatus(len(self.rows) + len(self.prefills), len(self.waiting), pages, self.budget.block_size)

    def fail_everything(self, cause: str) -> None:
        """Answer every job this worker knows of, and every job on the channel, with `WorkerDied`."""
        error = WorkerDied(cause)
        for item in self.lifecycle.mark_dead(cause, self.jobs):
            if item is not CLOSE:
                self.waiting.append(item)  # type: ignore[arg-type]
        for job in self.waiting:
            self.queue_gate.release()
            send_finished(job.reply, error)
        self.waiting.clear()
        for prefill in [*self.in_forward, *self.prefills]:
            self._safely(lambda: self._release_prefill(prefill))
            send_finished(prefill.reply, error)
        self.in_forward = []
        self.prefills.clear()
        for uid in list(self.rows.order):
            slot = self.rows.remove(uid)
            assert slot is not None
            self._safely(lambda: self._release_kv(slot))
            self._safely(lambda: self.budget.release(slot.blocks))
            send_finished(slot.reply, error)

    @staticmethod
    def _safely(action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:  # the state may be what broke; answering callers matters more
            log.exception("cleanup after a worker crash failed")
