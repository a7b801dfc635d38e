"""`ModelRunner`: the only part of the worker that touches the device.

It owns the decoder, the paged KV store and the batched sampler. The
scheduler sees it through two seams: as its `KvLeases` (lease, release and
measure each request's KV) and through `execute(plan)`, one forward over
the plan's decode rows and prompt chunks followed by one sampling call over
the requests that sample, returning a token id (or the error that stops that
request) for each. Another device or a graph-captured runner plugs in here
without the scheduler changing.

Failures: a forward that raises propagates (the scheduler fails every
request in it); a sampler that raises fails the requests it was sampling
(`InternalError` each); a row the sampler cannot sample gets its own
`SamplingError`. The worker keeps serving in every case.

The sampled ids come back as Python ints, so `execute` returns only once the
device has finished: its duration is the step's real cost on every device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ferrox_batch.errors import DecodeError, InternalError, KvAllocationFailed, KvPoolExhausted
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.models.batch_inputs import SeqChunk
from ferrox_batch.models.paged_kv import PagedKvStore
from ferrox_batch.models.sampler import BatchSampler
from ferrox_batch.scheduler.plan import StepPlan
from ferrox_batch.scheduler.request import Request

log = logging.getLogger("ferrox_batch.batch")


class ModelRunner:
    def __init__(self, decoder, store: PagedKvStore, sampler: BatchSampler) -> None:
        self.decoder = decoder
        self.store = store
        self.sampler = sampler
        self._next_seq = 0

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

    def execute(self, plan: StepPlan) -> list[int | TokenLogprob | DecodeError]:
        """Run `plan`'s forward, then sample every request in `plan.sampling`; one outcome each."""
        logits = self.decoder.forward([SeqChunk(seq_id, tokens) for seq_id, tokens in plan.inputs], self.store)
        sampling = plan.sampling
        if not sampling:
            return []
        outcomes: list[int | TokenLogprob | DecodeError] = []
        ready: list[int] = []  # indices into `sampling` of the requests that have a sampler row
        for i, request in enumerate(sampling):
            if request.sampler_row is None:
                try:
                    request.sampler_row = self.sampler.new_row(request.params.sampling, request.params.seed,
                                                               request.prefill_tokens, request.params.logprobs)
                except DecodeError as bad:
                    outcomes.append(bad)
                    continue
            outcomes.append(-1)  # filled below
            ready.append(i)
        picked = [plan.sampling_rows[i] for i in ready]
        if picked != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(picked, device=logits.device))
        try:
            tokens: Sequence[int | TokenLogprob | DecodeError] = self.sampler.sample(logits, [sampling[i].sampler_row for i in ready])
        except Exception as bad:  # the sampler itself failed: fail the requests it was sampling
            log.exception("sampler failed")
            tokens = [InternalError(f"sampling failed: {type(bad).__name__}: {bad}")] * len(ready)
        for i, token in zip(ready, tokens):
            outcomes[i] = token
        return outcomes
