"""A scheduler with no model: a fake KV lease table, fake sampled ids, and requests priced as the handle prices them.

`FakeKv` leases blocks out of a fixed pool and "runs" a plan by growing each
sequence by the tokens the plan feeds it, which is all a forward does to the
KV as the scheduler sees it. `Bench` wires a `Scheduler` with the real
admission modules and steps it: `step(sample)` is schedule -> fake forward ->
`update` with `sample(request)` as each sampling request's token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ferrox_batch.admission.block_budget import BlockBudget, blocks_for
from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.admission.counters import Counters
from ferrox_batch.admission.kv import KvElem, KvShape
from ferrox_batch.admission.queue import AbortInbox, QueueGate
from ferrox_batch.errors import DecodeError, KvPoolExhausted
from ferrox_batch.generation_types import GenerationParams, GenerationResult
from ferrox_batch.replies import Chunk, Finished
from ferrox_batch.scheduler import exits
from ferrox_batch.scheduler.plan import StepPlan
from ferrox_batch.scheduler.request import Request
from ferrox_batch.scheduler.scheduler import Scheduler
from ferrox_batch.scheduler.sink import OnceSink
from ferrox_batch.stop_tokens import StopTokens

VOCAB = 64


def letters(ids: Sequence[int]) -> bytes:
    """The test detokenizer: id -> one letter `'A' + id % 26`."""
    return bytes(ord("A") + i % 26 for i in ids)


class FakeKv:
    """KV leases out of `num_blocks` blocks of `block_size`, with no prefix cache; `fail_next` makes the
    next allocation fail. Each lease gets its own block ids, so the scheduler's distinct-block count is
    the plain sum."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.free = num_blocks
        self.seqs: dict[int, list] = {}  # seq_id -> [block ids, length]
        self.next_id = 0
        self.next_block = 0
        self.fail_next: DecodeError | None = None
        self.released: list[int] = []
        self.published: dict[int, list[int]] = {}
        self.leased: dict[int, tuple[list[int], object]] = {}  # seq_id -> (tokens it may adopt for, window)

    def peek(self, tokens: Sequence[int], salt: str | None) -> tuple[int, int]:
        return 0, 0

    def allocate(self, positions: int, tokens: Sequence[int] = (), salt: str | None = None,
                 window: object = None, every: int | None = None) -> int:
        """A lease of `blocks_for(positions)` blocks; a sliding one (`window`) holds as many, and `run` lets
        it grow past them as the store's sliding leases do."""
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        blocks = blocks_for(positions, self.block_size)
        if blocks > self.free:
            raise KvPoolExhausted()
        self.free -= blocks
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self.seqs[seq_id] = [list(range(self.next_block, self.next_block + blocks)), 0]
        self.leased[seq_id] = (list(tokens), window)
        self.next_block += blocks
        return seq_id

    def window_pool(self) -> tuple[int, int] | None:
        return None  # one kind of layer

    def publish(self, seq_id: int, tokens: Sequence[int]) -> None:
        self.published[seq_id] = list(tokens)

    def release(self, seq_id: int) -> int:
        blocks, _ = self.seqs.pop(seq_id)
        self.free += len(blocks)
        self.released.append(seq_id)
        return len(blocks)

    def length(self, seq_id: int) -> int:
        return self.seqs[seq_id][1]

    def blocks_of(self, seq_id: int) -> list[int]:
        return self.seqs[seq_id][0]

    def run(self, plan: StepPlan) -> None:
        """What a forward does to the KV: every sequence grows by the tokens fed to it."""
        for seq_id, tokens in plan.inputs:
            self.seqs[seq_id][1] += len(tokens)


class RecordingSink:
    """Every event a request got, in order."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def chunk(self, text: str) -> None:
        self.events.append(Chunk(text))

    def finished(self, outcome: GenerationResult | DecodeError) -> None:
        self.events.append(Finished(outcome))

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Chunk))

    @property
    def finals(self) -> list[GenerationResult | DecodeError]:
        return [e.result for e in self.events if isinstance(e, Finished)]

    @property
    def result(self) -> GenerationResult | DecodeError:
        assert len(self.finals) == 1, f"expected one final event, got {self.events}"
        return self.finals[0]


@dataclass
class Bench:
    config: BatcherConfig
    kv_blocks: int = 1024
    kv: FakeKv = field(init=False)
    scheduler: Scheduler = field(init=False)
    aborts: AbortInbox = field(default_factory=AbortInbox)
    sinks: dict[int, RecordingSink] = field(default_factory=dict)  # by abort id
    plans: list[StepPlan] = field(default_factory=list)
    now: float = 0.0  # the scheduler's clock (seconds): tests move it

    def __post_init__(self) -> None:
        self.kv = FakeKv(self.config.kv_block_size, self.kv_blocks)
        ceiling = ContextCeiling(None, KvShape(1, 1, KvElem.F32))
        self.scheduler = Scheduler(
            config=self.config, budget=BlockBudget(self.config.kv_block_size, self.kv_blocks, ceiling),
            queue_gate=QueueGate(self.config.max_queue), counters=Counters(), kv=self.kv, vocab_size=VOCAB,
            decode=letters, clock=lambda: self.now)

    def submit(self, prompt: Sequence[int], max_tokens: int = 4, *, stop_tokens: Sequence[int] = (),
               drained: bool = True, **params) -> Request:
        """A request priced and queued as the handle does it (queue slot taken, abort id allocated);
        `drained=False` leaves it "on the channel": the test adds it to the scheduler itself."""
        assert self.scheduler.queue_gate.try_reserve() is None, "the test's queue is full"
        positions = len(prompt) + max_tokens
        sink = RecordingSink()
        request = Request(list(prompt), GenerationParams(max_tokens=max_tokens, **params),
                          StopTokens(frozenset(stop_tokens)), OnceSink(sink), self.aborts.next_id(),
                          self.scheduler.budget.blocks_for(positions), positions)
        request.queued(self.now, self.config.max_queue_wait_ms)
        self.sinks[request.abort] = sink
        if drained:
            self.scheduler.add(request)
        return request

    def sink(self, request: Request) -> RecordingSink:
        return self.sinks[request.abort]

    def step(self, sample: Callable[[Request], int | DecodeError] = lambda r: 1,
             seconds: float | None = None) -> StepPlan:
        """One tick as the worker runs it: aborts, schedule, a fake forward, update."""
        stopped = exits.cancel(self.scheduler, self.aborts.drain())
        if stopped:
            self.aborts.add_aborted(stopped)
        plan = self.scheduler.schedule()
        self.plans.append(plan)
        if not plan.empty:
            self.kv.run(plan)
            self.scheduler.update(plan, [sample(r) for r in plan.sampling], seconds)
        return plan

    def run_until_idle(self, sample: Callable[[Request], int | DecodeError] = lambda r: 1,
                       limit: int = 10_000) -> int:
        for ticks in range(1, limit + 1):
            self.step(sample)
            if self.scheduler.idle:
                return ticks
        raise AssertionError("the scheduler did not go idle")

    def assert_nothing_held(self) -> None:
        s = self.scheduler
        assert s.idle
        assert s.budget.free() == self.kv_blocks
        assert self.kv.seqs == {}
        assert s.queue_gate.depth() == 0
