"""`max_prefills_per_tick`: several prompts share one tick's token budget; answers do not change.

With the default (1) every forward holds at most one prefill chunk (docs/upstream.md I8).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from batch_helpers import greedy_params, identity_decode, sequential_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_fakes import VOCAB, Bench
from worker_helpers import make_request, make_worker

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.admission.step_budget import MIN_PREFILL_CHUNK, prefill_budget
from ferrox_batch.engine.handle import ContinuousBatcher


class RecordingDecoder:
    """Delegates to the real decoder and records each forward's (decode rows, prefill chunk lengths)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.config, self.vocab_size = inner.config, inner.vocab_size
        self.device, self.dtype, self.kv_dtype = inner.device, inner.dtype, inner.kv_dtype
        self.forwards: list[tuple[int, list[int]]] = []

    def new_store(self, *args, **kwargs):
        return self.inner.new_store(*args, **kwargs)

    def forward(self, chunks, store):
        lens = [len(c.tokens) for c in chunks]
        first_prefill = next((i for i, n in enumerate(lens) if n > 1), len(lens))
        # Decodes come first; a 1-token prompt chunk after them counts as a prefill chunk too.
        decodes = sum(1 for c in chunks if len(c.tokens) == 1 and store.seq_len(c.seq_id) > 0
                      and chunks.index(c) < first_prefill)
        self.forwards.append((decodes, lens[decodes:]))
        return self.inner.forward(chunks, store)


def run_concurrently(batcher, prompts, params):
    """Queue every prompt before waiting on any (a burst that does not depend on thread start-up)."""
    tickets = [batcher.submit(prompt, params) for prompt in prompts]
    return [ticket.wait() for ticket in tickets]


PROMPTS = [[(7 * i + j) % 300 + 3 for j in range(5 + 9 * i)] for i in range(6)]


@pytest.mark.parametrize("per_tick,budget", [(1, 64), (3, 64), (6, 40), (4, 512)])
def test_prompts_sharing_a_tick_get_their_alone_answers_within_the_budget(tiny_batch_model, per_tick, budget):
    decoder = RecordingDecoder(tiny_batch_model.decoder)
    config = BatcherConfig(prefill_chunk=16, max_batch_tokens=budget, kv_block_size=4, kv_blocks=512,
                           max_prefills_per_tick=per_tick)
    params = greedy_params(6, ignore_eos=True)
    with ContinuousBatcher.spawn_with_config(decoder, identity_decode, config) as batcher:
        results = run_concurrently(batcher, PROMPTS, params)
        stats = batcher.stats()
    for prompt, result in zip(PROMPTS, results):
        assert list(result.token_ids) == sequential_ids(tiny_batch_model, prompt, params)
    assert stats.prefill_tokens == sum(len(p) for p in PROMPTS)
    most = 0
    for decodes, prefill_lens in decoder.forwards:
        assert len(prefill_lens) <= per_tick
        assert all(n <= 16 for n in prefill_lens)
        if prefill_lens:
            # The first chunk follows the step budget; the rest only use what is left of it.
            assert sum(prefill_lens) + decodes <= max(budget, decodes + MIN_PREFILL_CHUNK)
        most = max(most, len(prefill_lens))
    if per_tick > 1:
        assert most > 1, "a burst of prompts never shared a tick"


def test_the_knob_is_read_from_the_environment_and_validated():
    assert BatcherConfig.from_env({"FERROX_CB_MAX_PREFILLS_PER_TICK": "8"}).max_prefills_per_tick == 8
    assert BatcherConfig.from_env({}).max_prefills_per_tick == 1
    with pytest.raises(ValueError, match="FERROX_CB_MAX_PREFILLS_PER_TICK must be a positive integer"):
        BatcherConfig.from_env({"FERROX_CB_MAX_PREFILLS_PER_TICK": "0"})
    with pytest.raises(ValueError, match="max_prefills_per_tick"):
        BatcherConfig(max_prefills_per_tick=0)


def decoding_bench(config: BatcherConfig, rows: int, kv_blocks: int) -> Bench:
    """A scheduler under `config` with `rows` requests decoding (one-token prompts, prefilled in one wide tick)."""
    wide = dataclasses.replace(config, max_batch_tokens=rows + MIN_PREFILL_CHUNK, prefill_chunk=MIN_PREFILL_CHUNK,
                               max_prefills_per_tick=max(rows, 1))
    bench = Bench(wide, kv_blocks=kv_blocks)
    for i in range(rows):
        bench.submit([i % VOCAB], max_tokens=4)
    if rows:
        bench.step()
    assert len(bench.scheduler.decoding) == rows and not bench.scheduler.prefilling
    bench.scheduler.config = config  # from here on the scheduler plans under the tested config
    return bench


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 700), min_size=0, max_size=12),
    decode_rows=st.integers(0, 600),
    max_batch_tokens=st.integers(1, 2048),
    per_tick=st.integers(1, 8),
    chunk=st.integers(1, 512),
)
def test_a_ticks_prompt_chunks_keep_the_step_budget(prompts, decode_rows, max_batch_tokens, per_tick, chunk) -> None:
    """The first prompt gets exactly the step budget; the others share what is left, FIFO, each within its ceiling."""
    config = BatcherConfig(max_batch_tokens=max_batch_tokens, prefill_chunk=chunk, max_prefills_per_tick=per_tick,
                           max_queue=1024, kv_block_size=16)
    bench = decoding_bench(config, decode_rows, kv_blocks=4096)
    waiting = [bench.submit([(7 * i + j) % VOCAB for j in range(n)], max_tokens=4) for i, n in enumerate(prompts)]
    plan = bench.scheduler.schedule()
    assert len(plan.decodes) == decode_rows
    taken = plan.prompts
    if not prompts:
        assert taken == ()
        return
    assert [c.request for c in taken] == waiting[:len(taken)]  # FIFO off the front
    assert list(bench.scheduler.prefilling) == waiting, "the rest wait, in order"
    assert 1 <= len(taken) <= per_tick
    first_budget = prefill_budget(max_batch_tokens, decode_rows, chunk)
    assert len(taken[0].tokens) == min(prompts[0], first_budget)
    for i, c in enumerate(taken):
        assert c.tokens == c.request.prompt_tokens[:len(c.tokens)], "a prompt's chunk starts where it stands"
        assert c.last == (len(c.tokens) == prompts[i])
    for i, c in enumerate(taken[1:], start=1):
        assert 1 <= len(c.tokens) <= min(chunk, prompts[i])
    # Past the first chunk (which may use the MIN_PREFILL_CHUNK floor), the tick stays in budget.
    others = sum(len(c.tokens) for c in taken[1:])
    assert others == 0 or decode_rows + plan.prompt_tokens <= max_batch_tokens


@pytest.mark.parametrize("per_tick, finishes_first", [(1, False), (4, True)])
def test_an_unfinished_prompt_keeps_the_front_when_prompts_share_ticks(tiny_batch_model, per_tick, finishes_first):
    """The upstream tick (one prompt a tick) is round-robin; with several a tick, first come, first finished."""
    decoder = RecordingDecoder(tiny_batch_model.decoder)
    config = BatcherConfig(prefill_chunk=16, max_batch_tokens=16, kv_block_size=16, kv_blocks=64,
                           max_prefills_per_tick=per_tick)
    worker = make_worker(SimpleNamespace(decoder=decoder), config)
    prompts = [[(7 * i + j) % 300 + 3 for j in range(48)] for i in range(3)]  # 3 chunks of 16 each
    for prompt in prompts:
        request, _ = make_request(worker, prompt, greedy_params(2, ignore_eos=True))
        worker.jobs.put(request)
    for _ in range(9):
        worker.tick()
    first_done = next(i for i, forward in enumerate(decoder.forwards) if forward[0] > 0)  # first decode
    if finishes_first:
        assert first_done == 3, "the first prompt ran its three chunks back to back"
    else:
        assert first_done > 3, "round-robin: every prompt had a chunk before the first finished"
