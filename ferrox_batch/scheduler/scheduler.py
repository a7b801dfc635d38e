"""`Scheduler`: admission, the plan of each forward, and what the sampled tokens do.

The worker's loop is `schedule()` -> the runner's forward and sampling ->
`update(plan, sampled)`. Everything between is decided here, over ints and
lists, so tests drive it with fake sampled ids and a fake KV lease table.

`schedule()`:
1. flush: every request that finished (stop, length, cancelled, failed)
   frees its KV lease, returns its blocks to the ledger and gets its one
   reply (`exits`: every way a request leaves);
2. refuse every waiting request whose queue deadline has passed
   (`QueueTimeout`: it is never admitted late), then admit by (priority,
   arrival) -- lower priority values first, first come first served within
   one -- while `max_seqs` allows and the block ledger has room for the
   chosen request's reservation. The chosen request is the head, except with
   the prefix cache: then the one with the deepest cached prefix among the
   first 8 waiting of the head's priority (`cache_aware.choose`: a request
   is overtaken at most 4 times, only by a strictly deeper hit, so a cold
   cache is exactly FIFO, and never by a less urgent request). A chosen request that does not fit holds the line
   (nothing smaller behind it is tried): a large request is never starved
   by small ones. Admission leases the request's KV, so a
   prompt token outside the vocabulary, `max_tokens = 0` or a KV store that
   says no are answered here;
3. plan the forward: every decoding request's next token, and prompt chunks
   within the tick's token budget (`max_batch_tokens` after the decode rows,
   lowered by the step target once `step_cost` knows what a prompt token
   costs; see `step_budget` for the floor that keeps prompts advancing).
   The first waiting prompt gets up to `prefill_chunk` tokens; with
   `max_prefills_per_tick > 1` the prompts behind it share what is left.

`update()` advances each request by what the forward computed (checked
against the KV store's own lengths), moves prompts that are through to
decoding (offering their full prompt blocks to the prefix cache), applies each sampled token (stop tokens, stop strings, length,
streaming text to the request's sink), learns the tick's cost and flushes.

Prompt order: with one prompt a tick an unfinished prompt goes to the back
(round-robin, as the upstream tick); with several a tick the unfinished keep
the front, so each prompt joins the decode batch as early as it can.

After every update with a block budget the ledger is checked against the KV
store's leases (`exits.check_ledger`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from itertools import islice

from ferrox_batch.admission.block_budget import BlockBudget
from ferrox_batch.admission.cache_aware import MAX_SKIPS
from ferrox_batch.admission.config import DEFAULT_DECODE_LOG_INTERVAL, BatcherConfig
from ferrox_batch.admission.counters import Counters
from ferrox_batch.admission.queue import QueueGate
from ferrox_batch.admission.status import BatchStatus, PoolUsage, PrefillSnapshot, StatusReporter
from ferrox_batch.admission.step_budget import prefill_budget
from ferrox_batch.errors import DecodeError
from ferrox_batch.forward import Sampled
from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.scheduler import exits, progress
from ferrox_batch.scheduler.admission import accept, pick, reservation
from ferrox_batch.scheduler.isolation import failure
from ferrox_batch.scheduler.leases import KvLeases
from ferrox_batch.scheduler.speculation import drafted, plan_drafts
from ferrox_batch.scheduler.plan import PromptChunk, StepPlan
from ferrox_batch.scheduler.request import DecodeFn, Request
from ferrox_batch.scheduler.step_cost import StepCostModel
from ferrox_batch.scheduler.waiting import WaitingQueue

log = logging.getLogger("ferrox_batch.scheduler")


class Scheduler:
    def __init__(
        self,
        *,
        config: BatcherConfig,
        budget: BlockBudget,
        queue_gate: QueueGate,
        counters: Counters,
        kv: KvLeases,
        vocab_size: int,
        decode: DecodeFn,
        log_interval: int = DEFAULT_DECODE_LOG_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.budget = budget
        self.queue_gate = queue_gate
        self.counters = counters
        self.kv = kv
        self.vocab_size = vocab_size
        self.decode = decode
        self.prefix_cache = config.prefix_cache
        #: What `Request.queued_at` and `Request.deadline` are read on (tests pass a fake one).
        self.clock = clock
        aging = config.priority_aging_ms
        self.waiting = WaitingQueue(None if aging is None else aging / 1000)
        self.prefilling: deque[Request] = deque()
        self.decoding: list[Request] = []
        self.carried: set[int] = set()  # abort ids kept one tick for a request not yet drained
        self.orphans: set[int] = set()  # leases of answered requests that could not be ended (`exits`)
        self.step_cost = StepCostModel()
        self.reporter = StatusReporter(log_interval, 0.0)
        self.started = time.monotonic()

    # ------------------------------------------------------------ intake

    def add(self, request: Request) -> None:
        """A request from the channel (its queue slot is already taken), queued by priority, then arrival."""
        self.waiting.add(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.prefilling and not self.decoding

    def admitted(self) -> list[Request]:
        return [*self.decoding, *self.prefilling]

    # ---------------------------------------------------------- schedule

    def schedule(self) -> StepPlan:
        """Flush, refuse what waited too long, admit, and plan the next forward (empty when there is nothing to run)."""
        exits.flush(self)
        now = self.clock()
        exits.expire(self, now)
        self.waiting.age(now)
        self._admit()
        decodes = list(self.decoding)
        # Draft positions cost what prompt tokens do: a step with prompts to run spends itself on them.
        drafts = plan_drafts(decodes, self.config, prompts_pending=bool(self.prefilling))
        tick_tokens = self.step_cost.tick_tokens(self.config.max_batch_tokens, len(decodes),
                                                 self.config.step_target_ms)
        return StepPlan.build(decodes, self._prompt_chunks(len(decodes) + drafts, tick_tokens))

    def _admit(self) -> None:
        new_seqs = new_tokens = 0
        while self.waiting and len(self.decoding) + len(self.prefilling) < self.config.max_seqs:
            request, window, pick = self._pick()
            if request is None:
                break  # every waiting request follows a prompt still being computed
            reserve = reservation(request, self.kv)
            if isinstance(reserve, DecodeError):
                exits.refuse_waiting(self, request, reserve)
                continue
            if not self.budget.try_reserve(reserve):
                break  # the chosen request holds the line: nothing smaller is tried
            for passed in window[:pick]:
                passed.skips = min(passed.skips + 1, MAX_SKIPS)
            request.reserved = reserve
            refusal = self._accept(request)
            self.waiting.remove(request)
            self.queue_gate.release()
            if refusal is not None:
                # Blocks go back before the reply, so a caller that reads stats() after its
                # answer sees them free.
                self.budget.release(reserve)
                request.answer(refusal)
                continue
            self.prefilling.append(request)
            new_seqs += 1
            new_tokens += len(request.prompt_tokens)
        if new_seqs:  # blocks are reserved only here: only then can the peak rise
            snapshot = PrefillSnapshot(new_seqs, new_tokens, 0)
            log.info(self.reporter.report_prefill(self._now(), snapshot, self.batch_status()))
            self.counters.record_peak(self.budget.total - self.budget.free() if self.budget.total is not None
                                      else sum(r.reserved for r in self.admitted()))

    def _pick(self) -> tuple[Request | None, list[Request], int]:
        return pick(self.waiting, self.prefilling, self.kv, self.prefix_cache)

    def _accept(self, request: Request) -> GenerationResult | DecodeError | None:
        return accept(request, self.kv, self.vocab_size, self.clock, self.counters if self.prefix_cache else None)

    def _prompt_chunks(self, decode_rows: int, tick_tokens: int) -> list[PromptChunk]:
        if not self.prefilling:
            return []
        first = self.prefilling[0]
        budget = prefill_budget(tick_tokens, decode_rows, self.config.prefill_chunk)
        chunks = [PromptChunk.of(first, first.next_prompt_chunk(budget))]
        left = tick_tokens - decode_rows - len(chunks[0].tokens)
        for request in islice(self.prefilling, 1, None):
            if len(chunks) >= self.config.max_prefills_per_tick or left <= 0:
                break
            chunk = request.next_prompt_chunk(min(left, self.config.prefill_chunk))
            chunks.append(PromptChunk.of(request, chunk))
            left -= len(chunk)
        return chunks

    # ------------------------------------------------------------ update

    def update(self, plan: StepPlan, sampled: Sequence[Sampled], seconds: float | None = None,
               prompt_logprobs: Mapping[int, Sequence[TokenLogprob | None]] | None = None,
               pooled: Mapping[int, list[float]] | None = None) -> None:
        """Apply a forward that ran `plan` and the tokens sampled after it (`plan.sampling` order).

        `seconds`: how long the forward and sampling took, for the step target's cost model.
        `prompt_logprobs`: by index into `plan.prompts`, the log-probabilities of the prompt tokens that
        chunk's rows predict, for the requests that asked (`GenerationParams.prompt_logprobs`).
        `pooled`: by index into `plan.prompts`, the chunk's pooled hidden states (`GenerationParams.pooling`).
        """
        sampling = plan.sampling
        if len(sampled) != len(sampling):
            raise RuntimeError(f"the runner sampled {len(sampled)} tokens for {len(sampling)} requests")
        # A drafted row keeps the positions of its last token and its accepted draft tokens.
        kept = {id(r): len(o) for r, o in zip(sampling, sampled) if isinstance(o, tuple)} if plan.draft_tokens else {}
        for request in plan.decodes:
            progress.computed(request, kept.get(id(request), 1), self.kv)
            if plan.draft_tokens and request.draft:
                accepted = kept.get(id(request), 1) - 1
                self.counters.add_draft(len(request.draft), accepted)
                drafted(request, accepted, self.config)
        if plan.decodes:
            self.counters.add_decode_step()
            line = self.reporter.report_decode(self._now(), len(plan.decodes), self.batch_status())
            if line is not None:
                log.info(line)
        for index, chunk in enumerate(plan.prompts):
            self.counters.add_prefill(len(chunk.tokens))
            progress.computed(chunk.request, len(chunk.tokens), self.kv)
            if prompt_logprobs and index in prompt_logprobs and chunk.request.prompt_logprobs is not None:
                chunk.request.prompt_logprobs.extend(prompt_logprobs[index])
            if pooled and index in pooled:
                chunk.request.add_pooled(pooled[index])
        self._requeue_prompts(plan)
        for request, outcome in zip(sampling, sampled):
            if not isinstance(outcome, tuple):
                if request.going:
                    progress.sampled(request, outcome, self.decode)
                continue
            request.hold_chunks()  # a draft's accepted tokens and the one after them stream as one chunk
            try:
                for one in outcome:
                    if request.going:  # nothing after a stop, a length or a failure is applied
                        progress.sampled(request, one, self.decode)
            finally:
                request.release_chunks()
        if seconds is not None and self.config.step_target_ms is not None:
            self.step_cost.observe(len(plan.decodes), plan.prompt_tokens + plan.draft_tokens, seconds)
        exits.flush(self)
        exits.check_ledger(self)

    def _requeue_prompts(self, plan: StepPlan) -> None:
        """Prompts that are through start decoding; the rest are reordered (module docstring)."""
        for chunk in plan.prompts:
            request = chunk.request
            if request.prefill_remaining() == 0:
                self.prefilling.remove(request)
                request.prompt_done()
                self.decoding.append(request)
                if not request.samples:  # it only scored its prompt
                    request.finish = FinishReason.LENGTH
                # Its prompt's full blocks are final now: offered to the cache at once, so a request
                # admitted while this one still decodes (the next turn of a chat, another choice of the
                # same prompt) adopts them instead of waiting for this one to finish.
                assert request.seq_id is not None
                if request.going:
                    try:
                        self.kv.publish(request.seq_id, request.prefill_tokens)
                    except Exception as bad:  # the cache misses these blocks; the request goes on
                        failure("publishing its prompt blocks to the prefix cache", bad)
            elif self.config.max_prefills_per_tick == 1:
                self.prefilling.remove(request)
                self.prefilling.append(request)

    # ------------------------------------------------------------ status

    def _now(self) -> float:
        return time.monotonic() - self.started

    def batch_status(self) -> BatchStatus:
        total = self.budget.total
        pages = PoolUsage.empty() if total is None else PoolUsage.from_available(total, self.budget.free())
        kinds = self.kv.window_pool()
        window = None
        if kinds is not None and total is not None:  # a hybrid model: what each kind of layer holds
            window = (PoolUsage(min(kinds[0], total), total), PoolUsage(min(kinds[1], total), total))
        return BatchStatus(len(self.decoding) + len(self.prefilling), len(self.waiting), pages,
                           self.budget.block_size, window)
