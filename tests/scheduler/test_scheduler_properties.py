"""Invariants of the scheduler under random workloads, random cancels and random finishes (hypothesis).

Every tick: the ledger and the KV leases agree (`update` checks it), no forward exceeds its token budget
(beyond the floor that keeps prompts advancing) or `max_prefills_per_tick`, and admitted requests never
exceed `max_seqs`. At the end: every request got exactly one final event, after all of its text, and
nothing is held (blocks, leases, queue slots).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_fakes import VOCAB, Bench

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.admission.step_budget import MIN_PREFILL_CHUNK
from ferrox_batch.replies import Finished

requests_st = st.lists(
    st.tuples(
        st.lists(st.integers(0, VOCAB - 1), max_size=40),  # prompt
        st.integers(0, 12),  # max_tokens
        st.integers(0, 6),  # tick it arrives at
        st.one_of(st.none(), st.integers(0, 20)),  # tick it is cancelled at
    ),
    min_size=1, max_size=12,
)


@settings(max_examples=150)
@given(
    requests=requests_st,
    prefill_chunk=st.integers(1, 24),
    max_batch_tokens=st.integers(1, 48),
    max_prefills=st.integers(1, 4),
    max_seqs=st.integers(1, 6),
    block_size=st.sampled_from([1, 4, 16]),
    kv_blocks=st.integers(60, 200),
    stop_token=st.integers(0, VOCAB - 1),
    seed=st.integers(0, 2**16),
)
def test_random_workloads_keep_every_invariant(requests, prefill_chunk, max_batch_tokens, max_prefills, max_seqs,
                                               block_size, kv_blocks, stop_token, seed):
    config = BatcherConfig(prefill_chunk=prefill_chunk, max_batch_tokens=max_batch_tokens,
                           max_prefills_per_tick=max_prefills, max_seqs=max_seqs, kv_block_size=block_size,
                           kv_blocks=kv_blocks)
    bench = Bench(config, kv_blocks=kv_blocks)
    submitted = []
    state = seed

    def sample(_request) -> int:
        nonlocal state
        state = (state * 1103515245 + 12345) % 2**31
        return state % VOCAB

    for tick in range(400):
        for prompt, max_tokens, arrives, cancel_at in requests:
            if arrives == tick:
                if bench.scheduler.budget.blocks_for(len(prompt) + max_tokens) <= kv_blocks:
                    submitted.append((bench.submit(prompt, max_tokens, stop_tokens=[stop_token]), cancel_at))
        for request, cancel_at in submitted:
            if cancel_at == tick:
                bench.aborts.enqueue(request.abort)
        plan = bench.step(sample)
        rows = len(plan.decodes)
        assert rows + plan.prompt_tokens <= max(max_batch_tokens, rows + MIN_PREFILL_CHUNK)
        assert len(plan.prompts) <= max_prefills
        assert len(bench.scheduler.admitted()) <= max_seqs
        if tick > 6 and bench.scheduler.idle:
            break
    bench.assert_nothing_held()
    for request, _ in submitted:
        events = bench.sink(request).events
        assert sum(isinstance(e, Finished) for e in events) == 1
        assert isinstance(events[-1], Finished)
