"""`ModelRunner`: the only part of the worker that touches the device.

It owns the decoder, the paged KV store and the batched sampler. The
scheduler sees it through two seams: as its `KvLeases` (lease, release and
measure each request's KV) and through `execute(plan)`, one forward over
the plan's decode rows and prompt chunks followed by one sampling call over
the requests that sample, returning a token id (or the error that stops that
request) for each, and the log-probabilities of the prompt tokens of the
requests that asked for them (read from their chunks' own rows). Another device or a graph-captured runner plugs in here
without the scheduler changing.

Failures: a forward that raises propagates (the scheduler fails every
request in it). Everything after the forward is per row: a row whose sampler
state cannot be made, or that the sampler cannot sample, gets its own error
(`SamplingError`, `GrammarConstraint`, or `InternalError` for anything
unexpected); when the batched sampling call itself raises, each row is
sampled again alone, so only the rows that fail alone fail. The worker keeps
serving in every case.

The sampled ids come back as Python ints, so `execute` returns only once the
device has finished: its duration is the step's real cost on every device.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence

import torch

from ferrox_batch.errors import DecodeError, InternalError, KvAllocationFailed, KvPoolExhausted
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.models.batch_inputs import SeqChunk
from ferrox_batch.models.paged_kv import PagedKvStore
from ferrox_batch.models.sampler import BatchSampler
from ferrox_batch.scheduler.plan import PromptChunk, Sampled, StepOutput, StepPlan

log = logging.getLogger("ferrox_batch.batch")


class ModelRunner:
    def __init__(self, decoder, store: PagedKvStore, sampler: BatchSampler) -> None:
        self.decoder = decoder
        self.store = store
        self.sampler = sampler
        self._next_seq = 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # for grammar masks, made on first use

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    # ------------------------------------------------------------ KvLeases

    def peek(self, tokens: Sequence[int], salt: str | None) -> tuple[int, int]:
        return self.store.peek(tokens, salt)

    def allocate(self, positions: int, tokens: Sequence[int] = (), salt: str | None = None) -> int:
        seq_id = self._next_seq
        while self.store.has_sequence(seq_id):  # a shared store may hold others' sequences
            seq_id += 1
        self._next_seq = seq_id + 1
        try:
            self.store.add_sequence(seq_id, positions, tokens, salt)
        except KvPoolExhausted:  # the ledger said yes but the page store said no: the upstream's wording
            raise KvPoolExhausted() from None
        except (MemoryError, torch.OutOfMemoryError) as failed:
            log.warning("allocating KV for a request failed: %s", failed)
            raise KvAllocationFailed(f"{type(failed).__name__}: {failed}") from None
        return seq_id

    def publish(self, seq_id: int, tokens: Sequence[int]) -> None:
        self.store.publish(seq_id, tokens)

    def release(self, seq_id: int) -> int:
        return self.store.free_sequence(seq_id)

    def length(self, seq_id: int) -> int:
        return self.store.seq_len(seq_id)

    def blocks_of(self, seq_id: int) -> Sequence[int]:
        return self.store.seq(seq_id).blocks

    # ------------------------------------------------------------- execute

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run `plan`'s forward, then sample every request in `plan.sampling` (one outcome each), and score the
        prompt tokens of the chunks whose requests asked for their log-probabilities."""
        chunks = [SeqChunk(seq_id, tokens) for seq_id, tokens in plan.inputs]
        scored = [i for i, chunk in enumerate(plan.prompts) if chunk.request.params.prompt_logprobs is not None]
        outcomes, ready = self._rows(plan)
        rows = [plan.sampling[i].sampler_row for i in ready]
        # Grammar masks are computed on another thread while the forward runs, so they can overlap it where
        # cores are free; on a 2-core machine both compete for the same cores (measured in
        # docs/benchmarks.md: 0.09 ms of mask work per constrained row and token).
        masks = None
        if any(row.matcher is not None for row in rows):  # type: ignore[union-attr]
            masks = self._grammar_pool().submit(self.sampler.grammar_masks, rows)
        offset = len(plan.decodes)
        if scored:  # only a scored prompt needs every position's logits
            logits, every = self.decoder.forward_every(chunks, self.store, [offset + i for i in scored])
        else:
            logits, every = self.decoder.forward(chunks, self.store), []
        prompt_logprobs = {i: self._prompt_logprobs(plan.prompts[i], rows) for i, rows in zip(scored, every)}
        return StepOutput(self._sample(plan, logits, outcomes, ready, _computed_masks(masks)), prompt_logprobs)

    def _grammar_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ferrox-grammar")
        return self._pool

    def close(self) -> None:
        """Stop the grammar thread, if one was started."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _rows(self, plan: StepPlan) -> tuple[list[Sampled], list[int]]:
        """Every sampling request's sampler row, made when it first samples: (outcomes so far, with a
        placeholder where a row is ready, the indices into `plan.sampling` of the ready rows)."""
        outcomes: list[Sampled] = []
        ready: list[int] = []
        for i, request in enumerate(plan.sampling):
            if request.sampler_row is None:
                try:
                    request.sampler_row = self.sampler.new_row(request.params.sampling, request.params.seed,
                                                               request.prefill_tokens, request.params.logprobs,
                                                               request.grammar)
                except DecodeError as bad:
                    outcomes.append(bad)
                    continue
                except Exception as bad:  # this request's state, not the batch's
                    log.exception("making a sampler row failed")
                    outcomes.append(InternalError(f"preparing its sampler failed: {type(bad).__name__}: {bad}"))
                    continue
            outcomes.append(-1)  # filled by `_sample`
            ready.append(i)
        return outcomes, ready

    def _sample(self, plan: StepPlan, logits: torch.Tensor, outcomes: list[Sampled], ready: list[int],
                masks: tuple[list[int], torch.Tensor] | None) -> list[Sampled]:
        sampling = plan.sampling
        if not sampling:
            return []
        picked = [plan.sampling_rows[i] for i in ready]
        if picked != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(picked, device=logits.device))
        rows = [sampling[i].sampler_row for i in ready]
        try:
            tokens: Sequence[Sampled] = self.sampler.sample(logits, rows, masks)
        except Exception:
            # The batched call changes no row's state before its last, per-row part, so each row can
            # be sampled again alone: only the rows that cannot be sampled fail.
            log.exception("batched sampling failed; sampling each row alone")
            tokens = [self._sample_alone(logits[j:j + 1], row) for j, row in enumerate(rows)]
        for i, token in zip(ready, tokens):
            outcomes[i] = token
        return outcomes

    def _sample_alone(self, logits: torch.Tensor, row: object) -> Sampled:
        try:
            return self.sampler.sample(logits, [row])[0]
        except Exception as bad:
            log.exception("sampling one row failed")
            return InternalError(f"sampling failed: {type(bad).__name__}: {bad}")

    def _prompt_logprobs(self, chunk: PromptChunk, rows: torch.Tensor) -> list[TokenLogprob]:
        """The log-probabilities of the prompt tokens this chunk's rows predict: row j (position start + j)
        predicts the token at start + j + 1, which for the chunk's last row is the next chunk's first."""
        request = chunk.request
        prompt, start = request.prefill_tokens, request.num_computed_tokens  # not yet advanced by `update`
        count = min(len(chunk.tokens), len(prompt) - 1 - start)
        if count <= 0:
            return []
        k = request.params.prompt_logprobs or 0
        lp = rows[:count, : self.sampler.vocab_size].float().log_softmax(dim=-1)
        targets = torch.tensor(prompt[start + 1:start + 1 + count], device=lp.device)
        chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        top_v: list[list[float]] = [[] for _ in range(count)]
        top_i: list[list[int]] = [[] for _ in range(count)]
        if k:
            values, ids = lp.topk(k, dim=-1)
            top_v, top_i = values.tolist(), ids.tolist()
        return [TokenLogprob(t, c, tuple(zip(i, v))) for t, c, i, v in
                zip(prompt[start + 1:start + 1 + count], chosen, top_i, top_v)]


def _computed_masks(masks: concurrent.futures.Future | None) -> tuple[list[int], torch.Tensor] | None:
    """The grammar masks computed beside the forward; None (the sampler then computes them itself, row by
    row if need be) when there were none or computing them raised."""
    if masks is None:
        return None
    try:
        return masks.result()
    except Exception:
        log.exception("computing grammar masks beside the forward failed; the sampler computes them")
        return None
