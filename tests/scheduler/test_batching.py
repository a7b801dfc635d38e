"""Batching (upstream batching.rs; docs/upstream.md, Upstream tests): batching never changes an answer, and prefill is chunked and fair.

Pins: every request's ids equal the same request decoded alone
(`sequential_ids`), whatever else is in flight, whatever the chunk and tick
budget, over the paged store and for a sliding-window model; stop strings and
stop-token sets end a batched row as they end a private one; streamed chunks
are non-empty, arrive on the caller's thread and add up to the final text;
a request's prompt chunks (`Request.next_prompt_chunk`, advanced by
`num_computed_tokens`) are bounded and resumable and do not change the logits;
a long prompt prefills while a neighbour keeps decoding; `max_seqs` counts
prompts still prefilling.

Out of scope (not ported): grammar and json_object tests (no grammar
sampler yet). `a_window_model_slides_while_continuously_batched` lives with
the other sliding-window tests in `tests/engine/test_sliding_window.py`; here
a sliding-window model whose rows are too short to slide is checked against
its sequential ids.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from batch_helpers import (
    budget_config,
    greedy_params,
    identity_text,
    sequential_ids,
    spawn,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numerics import assert_logits_close
from tiny_checkpoint import write_tiny_checkpoint
from worker_helpers import Caller, Gate, wait_for, wait_sent

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import WORKER_THREAD_NAME, ContinuousBatcher
from ferrox_batch.generation_types import FinishReason, GenerationParams, SamplingParams
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.kv.paged_kv import PagedKvConfig
from ferrox_batch.scheduler.plan import PromptChunk, StepPlan
from ferrox_batch.scheduler.request import Request
from ferrox_batch.scheduler.sink import OnceSink, QueueSink
from ferrox_batch.stop_tokens import StopTokens


@pytest.fixture(scope="module")
def tiny_window_model(tmp_path_factory):
    from ferrox_batch.runtime.loading.loader import load_model

    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-window"), arch="mistral", sliding_window=5,
                                   tie=False, std=0.15, seed=6)
    return load_model(folder, device="cpu", dtype="float32")


def test_continuous_batching_composes_with_paged_kv(tiny_batch_model):
    decoder = tiny_batch_model.decoder
    store = decoder.new_store(4, num_blocks=16)
    gate = Gate()
    batcher = ContinuousBatcher.spawn_with_config_paged(decoder, gate, budget_config(4, None), PagedKvConfig(store))
    with batcher:
        assert batcher.store is store and batcher.stats().kv_blocks_total == 16
        params = greedy_params(10)
        first = Caller(batcher, [1, 2, 3], params)  # 13 positions: 4 blocks
        gate.wait_calls(1)  # decoding, held
        second = Caller(batcher, [9, 8, 7], params)
        wait_sent(batcher, 1)
        gate.open()
        for caller, prompt in ((first, [1, 2, 3]), (second, [9, 8, 7])):
            assert list(caller.join().token_ids) == sequential_ids(tiny_batch_model, prompt, params)
        stats = batcher.stats()
        assert stats.kv_blocks_peak == 8, "both rows held their pages at once"
        wait_for(lambda: batcher.stats().kv_blocks_free == 16, "every block back in the ledger")
        assert store.num_free_blocks == 16 and store.seq_ids() == []


def test_a_sliding_window_model_gives_the_sequential_ids_while_continuously_batched(tiny_window_model):
    assert tiny_window_model.decoder.config.sliding_window == 5
    params = greedy_params(12)
    prompts = [list(range(3, 43)), [7, 1, 4]]  # 40 tokens prefill in three chunks, across the window
    config = BatcherConfig(prefill_chunk=16, kv_block_size=4, kv_blocks=64)
    with spawn(tiny_window_model, config) as batcher:
        callers = [Caller(batcher, prompt, params) for prompt in prompts]
        for caller, prompt in zip(callers, prompts):
            assert list(caller.join().token_ids) == sequential_ids(tiny_window_model, prompt, params)


def test_continuous_batch_matches_sequential_generate_token_ids(tiny_batch_model):
    params = greedy_params(16)
    prompts = [[1, 2, 3, 4, 5], [42, 17]]
    with spawn(tiny_batch_model, budget_config(4, 64)) as batcher:
        callers = [Caller(batcher, prompt, params) for prompt in prompts]
        for caller, prompt in zip(callers, prompts):
            result = caller.join()
            assert result.finish_reason == FinishReason.LENGTH
            assert list(result.token_ids) == sequential_ids(tiny_batch_model, prompt, params)
            assert result.text == identity_text(result.token_ids)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(
        st.tuples(st.lists(st.integers(0, 383), max_size=24), st.integers(1, 6), st.integers(0, 3),
                  st.sampled_from([SamplingParams(), SamplingParams(temperature=0.9, top_k=40, top_p=0.95)])),
        min_size=1, max_size=4,
    ),
    prefill_chunk=st.sampled_from([1, 16, 20]),
    max_batch_tokens=st.sampled_from([16, 256]),
)
def test_batching_does_not_change_answers_even_when_sampling(tiny_batch_model, requests, prefill_chunk, max_batch_tokens):
    config = BatcherConfig(prefill_chunk=prefill_chunk, max_batch_tokens=max_batch_tokens, kv_block_size=4,
                           kv_blocks=128)
    with spawn(tiny_batch_model, config) as batcher:
        params = [GenerationParams(n, sampling, seed) for _, n, seed, sampling in requests]
        callers = [Caller(batcher, request[0], p) for request, p in zip(requests, params)]
        for caller, (prompt, n, _, _), p in zip(callers, requests, params):
            result = caller.join()
            assert list(result.token_ids) == sequential_ids(tiny_batch_model, prompt, p)
            assert result.usage.prompt_tokens == len(prompt) and result.usage.completion_tokens == n
        wait_for(lambda: batcher.stats().kv_blocks_free == 128, "every block back")


def test_continuous_batch_honors_stop_sequence_in_decoded_text(tiny_batch_model):
    prompt = [3, 1, 4, 1, 5]
    baseline = sequential_ids(tiny_batch_model, prompt, greedy_params(12))
    full = identity_text(baseline)
    stop = full[2:4]
    at = full.find(stop)
    with spawn(tiny_batch_model, budget_config(4, 64)) as batcher:
        result = batcher.generate(prompt, greedy_params(12, stop=[stop]))
    assert result.finish_reason == FinishReason.stop_sequence(stop)
    assert result.text == full[:at] and stop not in result.text
    # The token whose text completed the stop is in the ids; nothing after it.
    assert list(result.token_ids) == baseline[:at + len(stop)]


def test_continuous_batch_stops_on_any_member_of_the_stop_set(tiny_batch_model):
    prompt = [2, 7, 1, 8]
    baseline = sequential_ids(tiny_batch_model, prompt, greedy_params(12))
    expected = baseline[:baseline.index(baseline[2])]
    with spawn(tiny_batch_model, budget_config(4, 64)) as batcher:
        result = batcher.generate(prompt, greedy_params(12), StopTokens.of({baseline[2], 10_000}))
    assert result.finish_reason == FinishReason.STOP
    assert list(result.token_ids) == expected  # the terminator is not part of the output
    assert result.usage.completion_tokens == len(expected) and result.text == identity_text(expected)


@pytest.mark.parametrize("stop", [(), ("@@",)], ids=["no-stops", "stop-never-matching"])
def test_batched_generate_streams_incremental_chunks(tiny_batch_model, stop):
    chunks: list[str] = []
    with spawn(tiny_batch_model, budget_config(4, 64)) as batcher:
        result = batcher.generate_streaming([1, 2, 3], greedy_params(10, stop=stop), None, chunks.append)
    assert len(chunks) >= 2 and all(chunks)
    assert "".join(chunks) == result.text == identity_text(result.token_ids)


def test_on_chunk_runs_on_the_callers_thread(tiny_batch_model):
    threads: list[threading.Thread] = []
    with spawn(tiny_batch_model, budget_config(4, 64)) as batcher:
        batcher.generate_streaming([1, 2, 3], greedy_params(5), None, lambda _: threads.append(threading.current_thread()))
        caller = Caller(batcher, [4, 5], greedy_params(5),
                        on_chunk=lambda _: threads.append(threading.current_thread()))
        caller.join()
    assert len(threads) == 10
    assert threads[:5] == [threading.main_thread()] * 5
    assert threads[5:] == [caller.thread] * 5
    assert all(t.name != WORKER_THREAD_NAME for t in threads)


def _prompt_request(prompt: list[int], seq_id: int) -> Request:
    """An admitted request of `prompt` leasing KV sequence `seq_id`, nothing of its prompt run yet."""
    positions = len(prompt) + 1
    request = Request(list(prompt), greedy_params(1), StopTokens.default(), OnceSink(QueueSink()), 0, 1, positions)
    request.admitted(seq_id, time.monotonic)
    return request


def _run_prompt_chunk(request: Request, budget: int, decoder, store) -> tuple[bool, torch.Tensor]:
    """One forward of the request's next prompt chunk (at most `budget` tokens), fed as the runner feeds a plan,
    then the request advanced by it as the scheduler's update does; (the chunk was its last, its last logits)."""
    chunk = PromptChunk.of(request, request.next_prompt_chunk(budget))
    plan = StepPlan.build([], [chunk])
    logits = decoder.forward([SeqChunk(seq_id, tokens) for seq_id, tokens in plan.inputs], store)
    request.num_computed_tokens += len(chunk.tokens)
    assert store.seq_len(request.seq_id) == request.num_computed_tokens, "the KV holds what the request counts"
    assert chunk.last == (request.prefill_remaining() == 0)
    return chunk.last, logits[0]


def test_prompt_chunks_are_bounded_and_resumable(tiny_batch_model):
    decoder = tiny_batch_model.decoder
    store = decoder.new_store(4, num_blocks=8)
    store.add_sequence(0, 16)
    request = _prompt_request(list(range(1, 8)), 0)
    seen = []
    for _ in range(3):
        done, logits = _run_prompt_chunk(request, 3, decoder, store)
        seen.append((done, request.num_computed_tokens, store.seq_len(0)))
        assert logits.shape == (decoder.vocab_size,)
    assert seen == [(False, 3, 3), (False, 6, 6), (True, 7, 7)]
    assert request.next_prompt_chunk(3) == []  # through: nothing more to run
    assert request.num_computed_tokens == 7 and request.prefill_remaining() == 0 and store.seq_len(0) == 7


def test_empty_prompt_prefills_one_stand_in_token(tiny_batch_model):
    decoder = tiny_batch_model.decoder
    store = decoder.new_store(4, num_blocks=2)
    store.add_sequence(0, 4)
    request = _prompt_request([], 0)
    assert request.prefill_remaining() == 1 and request.prefill_tokens == [0]
    assert request.next_prompt_chunk(8) == [0]
    done, logits = _run_prompt_chunk(request, 8, decoder, store)
    assert done and request.num_computed_tokens == 1 and store.seq_len(0) == 1
    assert logits.shape == (decoder.vocab_size,)
    assert request.prompt_tokens == [], "the stand-in is fed, never counted as prompt"


def test_prefill_chunking_does_not_change_logits(tiny_batch_model):
    decoder = tiny_batch_model.decoder
    prompt = [(7 * i + 3) % decoder.vocab_size for i in range(13)]

    def prefill(chunk: int) -> torch.Tensor:
        store = decoder.new_store(4, num_blocks=8)
        store.add_sequence(0, len(prompt))
        request = _prompt_request(prompt, 0)
        last = None
        while request.prefill_remaining() > 0:
            _, last = _run_prompt_chunk(request, chunk, decoder, store)
        assert store.seq_len(0) == len(prompt)
        return last

    reference = prefill(1)  # token by token
    for chunk in (2, 5, 11, 64):
        assert_logits_close(prefill(chunk), reference, decoder.config, len(prompt))


def test_long_prefill_does_not_freeze_an_in_flight_decode(tiny_batch_model):
    gate = Gate()
    long_prompt = [(5 * i + 1) % 384 for i in range(40)]
    config = BatcherConfig(prefill_chunk=16, kv_block_size=4)
    with spawn(tiny_batch_model, config, decode=gate) as batcher:
        decoding = Caller(batcher, [1, 2, 3], greedy_params(30))
        gate.wait_calls(1)  # the short request is decoding (held at its first token)
        prefilling = Caller(batcher, long_prompt, greedy_params(1))
        wait_sent(batcher, 1)
        seen = []
        while prefilling.thread.is_alive() and len(seen) < 20:
            gate.step()  # one more token; the worker is held again, so stats are still
            stats = batcher.stats()
            seen.append((stats.prefill_tokens, stats.decode_steps))
        gate.open()
        assert list(decoding.join().token_ids) == sequential_ids(tiny_batch_model, [1, 2, 3], greedy_params(30))
        assert list(prefilling.join().token_ids) == sequential_ids(tiny_batch_model, long_prompt, greedy_params(1))
        stats = batcher.stats()
        assert stats.prefill_chunks == 4 and stats.prefill_tokens == 43  # 3, then 16 + 16 + 8
    partial = [(tokens, steps) for tokens, steps in seen if 3 < tokens < 43]
    assert len(partial) >= 2, f"the long prompt was never seen partly prefilled: {seen}"
    steps = [s for _, s in partial]
    assert steps == sorted(set(steps)), "every tick of the long prefill also ran a decode step"


def test_max_seqs_cap_counts_prefilling_prompts_and_still_serves_both(tiny_batch_model):
    params = greedy_params(8)
    prompts = [list(range(1, 21)), [6, 5, 4]]
    with spawn(tiny_batch_model, budget_config(4, 64, max_seqs=1)) as batcher:
        callers = [Caller(batcher, prompt, params) for prompt in prompts]
        for caller, prompt in zip(callers, prompts):
            assert list(caller.join().token_ids) == sequential_ids(tiny_batch_model, prompt, params)
        stats = batcher.stats()
    # One sequence at a time: never both jobs' blocks (7 and 3) at once.
    assert stats.max_seqs == 1 and stats.kv_blocks_peak == 7
