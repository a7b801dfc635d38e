"""Faults inside the batcher: what callers get, what the ledgers get back, and whether the worker lives on.

What this file pins:

* a forward that raises fails exactly the requests that were in it
  (`InternalError`); requests waiting for admission or prefilling outside that
  forward finish with their sequential answers; blocks, queue slots and KV
  pages all come back, and the worker serves later requests;
* a sampler that raises inside its batched call samples each row again
  alone, so only the row that makes it raise fails (`InternalError`); a
  row whose logits are NaN fails alone (`SamplingError`); the worker
  serves on;
* a decode (detokenizer) failure for one row fails that row only;
* a streaming callback that raises cancels its own request only, and the
  callback's exception reaches its caller;
* a KV store that lost one request's sequence behind the worker's back
  fails that request alone, and the worker serves on;
* a crash of the worker itself (a non-`Exception` escaping the tick, raised
  by the decode fn or the forward) answers every in-flight and waiting caller with `WorkerDied`
  promptly, refuses every later call at once, reports `worker_alive=False`,
  and leaves `queue_depth == 0` and every block free.
"""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import pytest
from batch_helpers import (
    budget_config,
    greedy_params,
    identity_decode,
    sequential_ids,
    spawn,
)

from ferrox_batch.engine import wiring as wiring_module
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.errors import InternalError, WorkerDied
from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.runtime.sampling.sampler import BatchSampler, SamplingError

JOIN_TIMEOUT = 30.0
# Distinct first tokens: the first chunk a sequence runs names its request.
PROMPTS = [[11 + 40 * k, 3, 5 + k, 7, 2 * k][: 3 + k % 3] for k in range(6)]


class FaultyDecoder:
    """The real decoder, plus recording and injected faults around `forward`."""

    def __init__(self, inner, *, fail_on: int | None = None, after_forward=None, poison=None) -> None:
        self.inner = inner
        self.config = inner.config
        self.vocab_size = inner.vocab_size
        self.device = inner.device
        self.dtype = inner.dtype
        self.kv_dtype = inner.kv_dtype
        self.fail_on = fail_on  # 1-based forward number that raises
        self.after_forward = after_forward  # called with (call number, chunks, store) once the forward ran
        self.poison = poison  # (first prompt token, decode step) whose logits become NaN
        self.calls = 0
        self.first_token: dict[object, int] = {}  # seq_id -> first token of its first chunk
        self.decodes: dict[object, int] = {}  # seq_id -> one-token forwards after its first (decode steps)
        self.failed_seqs: list[object] | None = None

    def new_store(self, *args, **kwargs):
        return self.inner.new_store(*args, **kwargs)

    def forward(self, chunks, store):
        self.calls += 1
        for chunk in chunks:
            if chunk.seq_id not in self.first_token:
                self.first_token[chunk.seq_id] = chunk.tokens[0]
            elif store.seq_len(chunk.seq_id) >= 1 and len(chunk.tokens) == 1:
                self.decodes[chunk.seq_id] = self.decodes.get(chunk.seq_id, 0) + 1
        if self.calls == self.fail_on:
            self.failed_seqs = [chunk.seq_id for chunk in chunks]
            raise RuntimeError("injected forward fault")
        logits = self.inner.forward(chunks, store)
        if self.after_forward is not None:
            self.after_forward(self.calls, chunks, store)
        if self.poison is not None:
            first, step = self.poison
            hit = [
                j for j, c in enumerate(chunks)
                if self.first_token[c.seq_id] == first and self.decodes.get(c.seq_id, 0) == step
            ]
            if hit:
                logits = logits.clone()  # the decoder's output is an inference tensor
                logits[hit] = float("nan")
        return logits

    def first_tokens_of(self, seq_ids) -> set[int]:
        return {self.first_token[s] for s in seq_ids}


def submit_all(batcher, jobs):
    """Stream every (prompt, params) from its own thread, all released at once.

    Returns (threads, outcome by job, chunks by job, monotonic time each caller was answered).
    """
    outcomes: dict[int, object] = {}
    chunks: dict[int, list[str]] = {k: [] for k in range(len(jobs))}
    answered: dict[int, float] = {}
    start = threading.Barrier(len(jobs))

    def go(k, prompt, params):
        start.wait(JOIN_TIMEOUT)
        try:
            outcomes[k] = batcher.generate_streaming(prompt, params, None, chunks[k].append)
        except BaseException as error:  # judged by the test
            outcomes[k] = error
        answered[k] = time.monotonic()

    threads = [threading.Thread(target=go, args=(k, p, q), daemon=True) for k, (p, q) in enumerate(jobs)]
    for t in threads:
        t.start()
    return threads, outcomes, chunks, answered


def join_all(threads) -> None:
    deadline = time.monotonic() + JOIN_TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a caller was never answered"


def assert_settled(batcher) -> None:
    """Every block and queue slot is back (a refusal is replied just before its blocks are released)."""
    deadline = time.monotonic() + JOIN_TIMEOUT  # returns as soon as settled; the bound only names a hang
    while True:
        stats = batcher.stats()
        if stats.kv_blocks_free == stats.kv_blocks_total and stats.queue_depth == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.01)
    assert stats.worker_alive
    assert batcher.store.seq_ids() == []
    assert batcher.store.num_free_blocks == batcher.store.num_blocks


def assert_serves(batcher, model) -> None:
    prompt, params = [9, 8, 7], greedy_params(6)
    result = batcher.generate(prompt, params)
    assert result.token_ids == tuple(sequential_ids(model, prompt, params))
    assert result.finish_reason == FinishReason.LENGTH


def assert_sequential(model, prompt, params, got, chunks) -> None:
    assert isinstance(got, GenerationResult), got
    assert got.token_ids == tuple(sequential_ids(model, prompt, params))
    assert got.text == identity_decode(got.token_ids).decode()
    assert "".join(chunks) == got.text


# --------------------------------------------------------------------------- forward faults


@pytest.mark.parametrize("fail_on", [1, 2, 6])
def test_a_failing_forward_fails_only_the_requests_in_it(tiny_batch_model, fail_on):
    model = tiny_batch_model
    decoder = FaultyDecoder(model.decoder, fail_on=fail_on)
    jobs = [(p, greedy_params(12)) for p in PROMPTS[:5]]
    with ContinuousBatcher.spawn_with_config(decoder, identity_decode, budget_config(4, 64, max_seqs=2)) as batcher:
        threads, outcomes, chunks, _ = submit_all(batcher, jobs)
        join_all(threads)
        assert decoder.failed_seqs, "the fault was never hit"
        failed = decoder.first_tokens_of(decoder.failed_seqs)
        for k, (prompt, params) in enumerate(jobs):
            if prompt[0] in failed:
                assert isinstance(outcomes[k], InternalError), outcomes[k]
                assert "injected forward fault" in str(outcomes[k])
            else:
                assert_sequential(model, prompt, params, outcomes[k], chunks[k])
        assert 1 <= len(failed) <= 2  # max_seqs bounds what one forward holds
        assert_settled(batcher)
        assert_serves(batcher, model)
    assert not batcher.stats().worker_alive


def test_a_prefill_failing_mid_prompt_gives_its_blocks_back(tiny_batch_model):
    """A 40-token prompt prefills in 16-token chunks; the second chunk's forward fails."""
    model = tiny_batch_model
    decoder = FaultyDecoder(model.decoder, fail_on=2)
    with ContinuousBatcher.spawn_with_config(decoder, identity_decode, budget_config(4, 32)) as batcher:
        with pytest.raises(InternalError):
            batcher.generate(list(range(1, 41)), greedy_params(8))
        assert decoder.failed_seqs is not None and len(decoder.failed_seqs) == 1
        assert_settled(batcher)
        assert batcher.stats().kv_blocks_peak == 12
        assert_serves(batcher, model)


# --------------------------------------------------------------------------- sampler faults


class FlakySampler(BatchSampler):
    """Raises whenever it samples the victim's row for its `fail_from`-th token or later: a fault carried by
    one request (its sampler state), hit inside the batched call that samples every row."""

    fail_from: ClassVar[int] = 3
    victim: ClassVar[tuple[int, ...]] = tuple(PROMPTS[1])
    instances: ClassVar[list[FlakySampler]] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompt_of: dict[int, tuple[int, ...]] = {}
        self.sampled: dict[int, int] = {}
        self.batched_faults = 0  # calls that raised while sampling more than the victim
        FlakySampler.instances.append(self)

    def new_row(self, params, seed, prompt_ids, *rest):
        row = super().new_row(params, seed, prompt_ids, *rest)
        self.prompt_of[id(row)] = tuple(prompt_ids)
        return row

    def sample(self, logits, rows, masks=None):
        for row in rows:
            if self.prompt_of[id(row)] == self.victim:
                self.sampled[id(row)] = self.sampled.get(id(row), 0) + 1
                if self.sampled[id(row)] >= self.fail_from:
                    self.batched_faults += len(rows) > 1
                    raise RuntimeError("injected sampler fault")
        return super().sample(logits, rows, masks)


def test_a_sampler_that_raises_fails_only_the_row_that_makes_it_raise(tiny_batch_model, monkeypatch):
    model = tiny_batch_model
    FlakySampler.instances.clear()
    monkeypatch.setattr(wiring_module, "BatchSampler", FlakySampler)
    batcher = spawn(model, budget_config(4, 64, max_seqs=3))
    monkeypatch.undo()
    with batcher:
        (sampler,) = FlakySampler.instances
        jobs = [(p, greedy_params(10)) for p in PROMPTS[:5]]
        threads, outcomes, chunks, _ = submit_all(batcher, jobs)
        join_all(threads)
        assert sampler.batched_faults, "the fault never hit a batched call"
        for k, (prompt, params) in enumerate(jobs):
            if tuple(prompt) == FlakySampler.victim:
                assert isinstance(outcomes[k], InternalError), outcomes[k]
                assert "injected sampler fault" in str(outcomes[k])
            else:  # sampled again alone after the batched call raised: the same tokens as alone
                assert_sequential(model, prompt, params, outcomes[k], chunks[k])
        assert_settled(batcher)
        assert_serves(batcher, model)


def test_a_row_whose_logits_are_nan_fails_alone(tiny_batch_model):
    model = tiny_batch_model
    victim = PROMPTS[1]
    decoder = FaultyDecoder(model.decoder, poison=(victim[0], 3))
    jobs = [(p, greedy_params(10)) for p in PROMPTS[:4]]
    with ContinuousBatcher.spawn_with_config(decoder, identity_decode, budget_config(4, 64)) as batcher:
        threads, outcomes, chunks, _ = submit_all(batcher, jobs)
        join_all(threads)
        for k, (prompt, params) in enumerate(jobs):
            if prompt is victim:
                assert isinstance(outcomes[k], SamplingError), outcomes[k]
                assert "NaN" in str(outcomes[k])
                # What it streamed before failing was its own (sequential) output.
                want = identity_decode(sequential_ids(model, prompt, params)).decode()
                # Tokens 1-3 were sampled from the prefill and decodes 1-2; decode 3's logits were NaN.
                assert "".join(chunks[k]) == want[:3]
            else:
                assert_sequential(model, prompt, params, outcomes[k], chunks[k])
        assert_settled(batcher)
        assert_serves(batcher, model)


def test_a_decode_fn_that_raises_fails_only_its_own_row(tiny_batch_model):
    """A detokenizer that cannot render one id (e.g. a padded lm-head id the tokenizer lacks) is that row's fault."""
    model = tiny_batch_model
    jobs = [(p, greedy_params(10)) for p in PROMPTS[:4]]
    refs = [sequential_ids(model, p, q) for p, q in jobs] + [sequential_ids(model, [9, 8, 7], greedy_params(6))]
    # A token only the third request samples (the last reference is `assert_serves`'s request).
    bad_id = next(t for t in refs[2] if all(t not in r for k, r in enumerate(refs) if k != 2))

    def decode(ids):
        if bad_id in ids:
            raise ValueError(f"token id {bad_id} is outside the tokenizer's ids")
        return identity_decode(ids)

    with spawn(model, budget_config(4, 64), decode=decode) as batcher:
        threads, outcomes, chunks, _ = submit_all(batcher, jobs)
        join_all(threads)
        assert batcher.stats().worker_alive, "one row's detokenizer error took the whole worker down"
        for k, (prompt, params) in enumerate(jobs):
            if k == 2:
                assert isinstance(outcomes[k], InternalError), outcomes[k]
            else:
                assert_sequential(model, prompt, params, outcomes[k], chunks[k])
        assert_settled(batcher)
        assert_serves(batcher, model)


def test_a_streaming_callback_that_raises_cancels_only_its_own_request(tiny_batch_model):
    model = tiny_batch_model

    class ClientGone(Exception):
        pass

    seen: list[str] = []

    def on_chunk(text: str) -> None:
        seen.append(text)
        if len(seen) == 2:
            raise ClientGone()

    with spawn(model, budget_config(4, 64)) as batcher:
        neighbour_prompt, neighbour_params = PROMPTS[0], greedy_params(20)
        result: dict[str, object] = {}
        thread = threading.Thread(
            target=lambda: result.setdefault("r", batcher.generate(neighbour_prompt, neighbour_params)), daemon=True
        )
        thread.start()
        with pytest.raises(ClientGone):
            batcher.generate_streaming(PROMPTS[1], greedy_params(200), None, on_chunk)
        thread.join(JOIN_TIMEOUT)
        assert not thread.is_alive()
        assert result["r"].token_ids == tuple(sequential_ids(model, neighbour_prompt, neighbour_params))
        assert len(seen) == 2
        assert_settled(batcher)
        assert batcher.stats().aborted == 1
        assert_serves(batcher, model)


def test_a_store_that_loses_one_sequence_fails_that_request_alone(tiny_batch_model):
    model = tiny_batch_model
    lost: list[int] = []

    def after_forward(call, chunks, store):
        if call == 4:  # a decode row's sequence vanishes from the store
            lost.append(decoder.first_tokens_of([chunks[0].seq_id]).pop())
            store.free_sequence(chunks[0].seq_id)

    decoder = FaultyDecoder(model.decoder, after_forward=after_forward)
    jobs = [(p, greedy_params(12)) for p in PROMPTS[:4]]
    batcher = ContinuousBatcher.spawn_with_config(decoder, identity_decode, budget_config(4, 128, max_seqs=4))
    with batcher:
        threads, outcomes, chunks, _ = submit_all(batcher, jobs)
        join_all(threads)
        assert len(lost) == 1
        for k, (prompt, params) in enumerate(jobs):
            if prompt[0] == lost[0]:
                assert isinstance(outcomes[k], InternalError) and "KeyError" in str(outcomes[k]), outcomes[k]
            else:
                assert_sequential(model, prompt, params, outcomes[k], chunks[k])
        assert batcher.stats().worker_alive
        assert_settled(batcher)
        assert_serves(batcher, model)


# --------------------------------------------------------------------------- worker crash


class Crash(BaseException):
    """Not an `Exception`: nothing on the per-request fault paths catches it."""


def crash() -> None:
    raise Crash("injected crash")


@pytest.mark.parametrize("how", ["decode_raises_base_exception", "forward_raises_base_exception"])
def test_a_crashed_worker_answers_everyone_and_refuses_later_calls(tiny_batch_model, how):
    model = tiny_batch_model
    # Nobody polls the worker's liveness: each caller hears of the death from the dying worker
    # (through its sink) or is refused at once. The 5 s bounds below say "answered at once"
    # without being tight enough for a loaded machine to trip; the callers' join bound is 30 s.
    held, release = threading.Event(), threading.Event()
    decodes = 0

    def hold_then(fault):
        # Hold the worker inside its 3rd decode / 4th forward until every caller is in, then fault.
        held.set()
        assert release.wait(JOIN_TIMEOUT), "the test never released the worker"
        fault()

    def decode(ids):
        nonlocal decodes
        decodes += 1
        if how == "decode_raises_base_exception" and decodes == 3:
            hold_then(crash)
        return identity_decode(ids)

    def after_forward(call, chunks, store):
        if how == "forward_raises_base_exception" and call > 1 and any(len(c.tokens) > 1 for c in chunks):
            hold_then(crash)  # a later prompt's chunk, next to a decode: taken off the prefill queue

    decoder = FaultyDecoder(model.decoder, after_forward=after_forward)
    jobs = [(p, greedy_params(100)) for p in PROMPTS[:5]]
    batcher = ContinuousBatcher.spawn_with_config(decoder, decode, budget_config(4, 128, max_seqs=2, max_queue=8))
    try:
        threads, outcomes, _, answered = submit_all(batcher, jobs)
        # Once the worker is held, every caller is either admitted (its sequence reached the
        # decoder) or waiting in the queue.
        assert held.wait(JOIN_TIMEOUT)
        deadline = time.monotonic() + JOIN_TIMEOUT
        while batcher.stats().queue_depth + len(decoder.first_token) < len(jobs):
            assert time.monotonic() < deadline, batcher.stats()
            time.sleep(0.01)
        in_flight = len(decoder.first_token)
        assert 1 <= in_flight <= 2
        released = time.monotonic()
        release.set()
        join_all(threads)
        for k in range(len(jobs)):
            assert isinstance(outcomes[k], WorkerDied), outcomes[k]
            assert answered[k] - released < 5.0, "a caller waited on a dead worker"
        cause = outcomes[0].cause
        assert "Crash" in cause, cause
        # Later calls are refused at once, with the same cause.
        t0 = time.monotonic()
        with pytest.raises(WorkerDied) as later:
            batcher.generate(PROMPTS[0], greedy_params(4))
        assert time.monotonic() - t0 < 5.0
        assert later.value.cause == cause
        stats = batcher.stats()
        assert stats.worker_alive is False
        assert stats.queue_depth == 0
        assert stats.kv_blocks_free == stats.kv_blocks_total
    finally:
        release.set()
        assert batcher.close(timeout=10)
