"""`ModelRunner`: the only part of the engine that touches the device.

It owns the decoder, the paged KV store and the batched sampler, and it knows the scheduler only through
the shared vocabulary of a forward (`ferrox_batch.forward`). The scheduler sees it through two seams: as
its `KvLeases` (lease, release and measure each request's KV) and through `execute(plan)`, one forward over
a `ForwardPlan`'s decode rows and prompt chunks followed by one sampling call over the rows that sample,
returning a token id (or the error that stops that request) for each, and the log-probabilities of the
prompt tokens of the chunks that asked for them (read from their own rows). Another device or a
graph-captured runner plugs in here without the scheduler changing.

Each sequence's sampling state (`RowSampler`: its generator, penalty window, bias, grammar matcher) is the
runner's own: made when the sequence first samples, from what its `RowToSample` carries, and dropped when
its lease is released. The decoder is seen through `Decoder`.

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

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from ferrox_batch.admission.kv_groups import GroupPricing
from ferrox_batch.admission.window import WindowPolicy
from ferrox_batch.errors import DecodeError, InternalError, KvAllocationFailed, KvPoolExhausted
from ferrox_batch.forward import ForwardPlan, GrammarComplete, RowToSample, Sampled, StepOutput
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.kv.paged_kv import PagedKvStore
from ferrox_batch.runtime.sampling.logprobs import prompt_logprobs
from ferrox_batch.runtime.sampling.sampler import BatchSampler, RowSampler
from ferrox_batch.runtime.sampling.sampler_rows import PreparedBias

if TYPE_CHECKING:
    from ferrox_batch.runtime.sampling.sampler import StartedMasks

log = logging.getLogger("ferrox_batch.runtime")


class Decoder(Protocol):
    """What the runner runs forwards on (`architectures.decoder.Decoder`, or a wrapper in tests)."""

    @property
    def vocab_size(self) -> int: ...

    def forward(self, chunks: Sequence[SeqChunk], store: PagedKvStore) -> torch.Tensor:
        """Logits of each chunk's last position, `[len(chunks), >= vocab_size]`."""
        ...

    def forward_every(self, chunks: Sequence[SeqChunk], store: PagedKvStore,
                      every: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward`'s logits, and every position's logits of the chunks indexed by `every`."""
        ...


class ModelRunner:
    def __init__(self, decoder: Decoder, store: PagedKvStore, sampler: BatchSampler,
                 window: WindowPolicy | None = None) -> None:
        self.decoder = decoder
        self.store = store
        self.sampler = sampler
        #: How a lease's local KV groups slide (`admission.window`): the model's window over this store's
        #: blocks. None: every lease keeps every position.
        self.window = window
        #: What a row costs over the store's KV groups (`admission.kv_groups`): what the handle prices with.
        self.pricing: GroupPricing = store.groups.pricing(window)
        self._next_seq = 0
        self._samplers: dict[int, RowSampler] = {}  # by seq_id: from a sequence's first sample to its release

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    # ------------------------------------------------------------ KvLeases

    def peek(self, tokens: Sequence[int], salt: str | None) -> tuple[int, int]:
        return self.store.peek(tokens, salt)

    def allocate(self, positions: int, tokens: Sequence[int] = (), salt: str | None = None,
                 window: WindowPolicy | None = None, every: int | None = None) -> int:
        seq_id = self._next_seq
        while self.store.has_sequence(seq_id):  # a shared store may hold others' sequences
            seq_id += 1
        self._next_seq = seq_id + 1
        try:
            self.store.add_sequence(seq_id, positions, tokens, salt, window=window, every=every)
        except KvPoolExhausted:  # the ledger said yes but the page store said no: the upstream's wording
            raise KvPoolExhausted() from None
        except (MemoryError, torch.OutOfMemoryError) as failed:
            log.warning("allocating KV for a request failed: %s", failed)
            raise KvAllocationFailed(f"{type(failed).__name__}: {failed}") from None
        return seq_id

    def publish(self, seq_id: int, tokens: Sequence[int]) -> None:
        self.store.publish(seq_id, tokens)

    def release(self, seq_id: int) -> int:
        self._samplers.pop(seq_id, None)
        return self.store.free_sequence(seq_id)

    def length(self, seq_id: int) -> int:
        return self.store.seq_len(seq_id)

    def blocks_of(self, seq_id: int) -> Sequence[int]:
        return self.store.seq(seq_id).blocks

    def window_pool(self) -> tuple[int, int] | None:
        groups = self.store.groups
        return self.store.blocks_by_kind() if groups.global_groups and groups.local_groups else None

    # ------------------------------------------------------------- execute

    def execute(self, plan: ForwardPlan) -> StepOutput:
        """Run `plan`'s forward, then sample every row in `plan.sampling` (one outcome each), and score the
        prompt tokens of the chunks in `plan.scoring`."""
        # A drafted row's positions are decode queries, so each is computed exactly as the step it stands for.
        drafted_inputs = {plan.sampling[i].row for i in plan.drafted} if plan.drafted else ()
        chunks = [SeqChunk(seq_id, tokens, i in drafted_inputs) for i, (seq_id, tokens) in enumerate(plan.inputs)]
        outcomes, ready = self._rows(plan.sampling)
        rows = [self._samplers[plan.sampling[i].seq_id] for i in ready]
        # Grammar masks are computed on other threads while the forward runs, so they can overlap it where
        # cores are free; on a 2-core machine both compete for the same cores (measured in
        # docs/benchmarks.md: 0.09 ms of mask work per constrained row and token). After the forward the
        # worker waits for them at most the grammar engine's deadline: a row whose mask is later fails alone.
        masks = self.sampler.start_masks(rows) if any(row.matcher is not None for row in rows) else None
        # Every position's logits for scored prompts and for drafted rows (verified position by position).
        # The drafted rows whose sampler row is ready (one that could not be made failed its request).
        drafted = sorted(set(plan.drafted).intersection(ready)) if plan.drafted else []
        every_inputs = sorted({p.input for p in plan.scoring} | {plan.sampling[i].row for i in drafted})
        pooled: dict[int, list[float]] = {}
        if plan.pooling:  # an embedding's prompt: its final hidden states, pooled
            logits, every, states = self.decoder.forward_pooled(chunks, self.store, every_inputs,
                                                                [(p.input, p.mode) for p in plan.pooling])
            pooled = {p.key: state.tolist() for p, state in zip(plan.pooling, states)}
        elif every_inputs:
            logits, every = self.decoder.forward_every(chunks, self.store, every_inputs)
        else:
            logits, every = self.decoder.forward(chunks, self.store), []
        spans = dict(zip(every_inputs, every))
        scored = {p.key: prompt_logprobs(spans[p.input], p.targets, p.top, self.sampler.vocab_size)
                  for p in plan.scoring}
        if drafted:  # a drafted row samples its first position from its last token's logits
            logits = logits.clone()
            for i in drafted:
                logits[plan.sampling[i].row] = spans[plan.sampling[i].row][0]
        sampled: list = self._sample(plan.sampling, logits, outcomes, ready, rows, masks)
        if drafted:
            self._verify(plan.sampling, drafted, spans, sampled)
        for i in set(plan.drafted) - set(drafted):  # a row that could not sample keeps its last token's position
            self.store.seq(plan.sampling[i].seq_id).length -= len(plan.sampling[i].draft)
        return StepOutput(sampled, scored, pooled)

    def _verify(self, sampling: Sequence[RowToSample], drafted: list[int], spans: dict[int, torch.Tensor],
                sampled: list) -> None:
        """Each drafted row's positions sampled in order, with its own state, while the samples equal its
        draft: its outcome becomes the tuple of the samples it keeps (the agreeing ones, then the first that
        disagreed, or the one after the whole draft). Its KV keeps the positions of its last token and its
        accepted draft tokens; the rest are written over later (`scheduler.speculation`)."""
        kept = {i: [sampled[i]] for i in drafted}
        alive = [i for i in drafted if _agrees(sampled[i], sampling[i].draft, 0)]
        alive = self._verify_at_once(sampling, alive, spans, kept)
        position = 1
        while alive:
            rows = [self._samplers[sampling[i].seq_id] for i in alive]
            logits = torch.stack([spans[sampling[i].row][position] for i in alive])
            try:
                outs: Sequence[Sampled] = self.sampler.sample(logits, rows)
            except Exception:
                log.exception("batched sampling of drafted positions failed; sampling each row alone")
                outs = [self._sample_alone(logits[j:j + 1], row) for j, row in enumerate(rows)]
            for i, out in zip(alive, outs):
                kept[i].append(out)
            alive = [i for i, out in zip(alive, outs) if _agrees(out, sampling[i].draft, position)]
            position += 1
        for i in drafted:
            seq = self.store.seq(sampling[i].seq_id)
            seq.length -= len(sampling[i].draft) + 1 - len(kept[i])
            sampled[i] = tuple(kept[i])

    def _verify_at_once(self, sampling: Sequence[RowToSample], alive: list[int], spans: dict[int, torch.Tensor],
                        kept: dict[int, list[Sampled]]) -> list[int]:
        """Verify the drafted rows whose samples depend on nothing sampled before (`RowSampler.memoryless`:
        a plain greedy row) with one sampling call over all their positions, the same samples the position
        by position loop would draw; the rows left for that loop. A position past a row's first
        disagreement is sampled and dropped (what it costs is a few rows of a cheap call)."""
        rows = {i: self._samplers[sampling[i].seq_id] for i in alive}
        at_once = [i for i in alive if rows[i].memoryless]
        if not at_once:
            return alive
        logits = torch.cat([spans[sampling[i].row][1:len(sampling[i].draft) + 1] for i in at_once])
        repeated = [rows[i] for i in at_once for _ in sampling[i].draft]
        try:
            outs: Sequence[Sampled] = self.sampler.sample(logits, repeated)
        except Exception:
            log.exception("sampling drafted positions at once failed; sampling them position by position")
            return alive
        start = 0
        for i in at_once:
            draft = sampling[i].draft
            for position, out in enumerate(outs[start:start + len(draft)], start=1):
                kept[i].append(out)
                if not _agrees(out, draft, position):
                    break
            start += len(draft)
        done = set(at_once)
        return [i for i in alive if i not in done]

    def close(self) -> None:
        """Stop the grammar mask threads, if any were started."""
        if self.sampler.grammars is not None:
            self.sampler.grammars.close()

    def _rows(self, sampling: Sequence[RowToSample]) -> tuple[list[Sampled], list[int]]:
        """Every sampling row's state, made when its sequence first samples: (outcomes so far, with a
        placeholder where a row is ready, the indices into `sampling` of the ready rows)."""
        outcomes: list[Sampled] = []
        ready: list[int] = []
        for i, row in enumerate(sampling):
            if row.seq_id not in self._samplers:
                try:
                    prepared = row.bias if isinstance(row.bias, PreparedBias) else None  # made at submit
                    self._samplers[row.seq_id] = self.sampler.new_row(row.sampling, row.seed, row.window,
                                                                      row.logprobs, row.grammar, row.held,
                                                                      row.hold_for, prepared)
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

    def _sample(self, sampling: Sequence[RowToSample], logits: torch.Tensor, outcomes: list[Sampled],
                ready: list[int], rows: list[RowSampler], started: StartedMasks | None) -> list[Sampled]:
        if not sampling:
            return []
        masks = None
        if started is not None:
            masks, late = self.sampler.collect_masks(started)
            if late:  # those rows end with their own error; the others sample as if they were not there
                for j, error in late.items():
                    outcomes[ready[j]] = error
                kept = [j for j in range(len(rows)) if j not in late]
                new_index = {old: new for new, old in enumerate(kept)}
                if masks is not None:
                    masks = ([new_index[j] for j in masks[0]], masks[1])
                ready, rows = [ready[j] for j in kept], [rows[j] for j in kept]
                if not rows:
                    return outcomes
        picked = [sampling[i].row for i in ready]
        if picked != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(picked, device=logits.device))
        try:
            tokens: Sequence[Sampled] = self.sampler.sample(logits, rows, masks)
        except Exception:
            # The batched call changes no row's state before its last, per-row part, so each row can
            # be sampled again alone: only the rows that cannot be sampled fail.
            log.exception("batched sampling failed; sampling each row alone")
            tokens = [self._sample_alone(logits[j:j + 1], row, _row_mask(masks, j)) for j, row in enumerate(rows)]
        for i, token in zip(ready, tokens):
            outcomes[i] = token
        return outcomes

    def _sample_alone(self, logits: torch.Tensor, row: RowSampler,
                      mask: tuple[list[int], torch.Tensor] | None = None) -> Sampled:
        try:
            return self.sampler.sample(logits, [row], mask)[0]
        except Exception as bad:
            log.exception("sampling one row failed")
            return InternalError(f"sampling failed: {type(bad).__name__}: {bad}")


def _agrees(outcome: Sampled, draft: Sequence[int], position: int) -> bool:
    """Whether a drafted row goes on past `position`: its sample there is its draft's token and the row
    neither failed nor completed its grammar (the sample after the whole draft always ends it)."""
    if position >= len(draft) or isinstance(outcome, (DecodeError, GrammarComplete)):
        return False
    token = outcome.token if isinstance(outcome, TokenLogprob) else outcome
    return token == draft[position]


def _row_mask(masks: tuple[list[int], torch.Tensor] | None, j: int) -> tuple[list[int], torch.Tensor] | None:
    """Row `j`'s own mask out of a batch's, as `sample` takes it for that row alone (None: it has none)."""
    if masks is None or j not in masks[0]:
        return None
    k = masks[0].index(j)
    return [0], masks[1][k:k + 1]
