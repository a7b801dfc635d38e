"""The prefix cache end to end on a tiny checkpoint: an adopted prefix gives what computing it gives.

Pins: a request whose prompt prefix was published by an earlier one adopts those blocks (its prefill
starts after them, and the KV store's length says so), and its greedy tokens equal the same request decoded
alone; the logits after a warm prefill equal a cold one's within what two float32 forwards may differ by
(`numerics.assert_logits_close`, derived from the arithmetic); a fully cached prompt still computes its last
token; a salted request adopts only its own namespace's blocks; a request publishes its prompt's blocks as
soon as its prompt is through (a request sent while it decodes adopts them), and a failed one publishes
nothing after that (nothing at all when it failed mid-prompt); two requests with the same new prefix both
finish correctly whichever publishes first; and the ledger comes back whole, with cached blocks counted
free.
"""

from __future__ import annotations

import threading

from batch_helpers import greedy_params, sequential_ids, spawn
from numerics import assert_logits_close

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.generation_types import GenerationParams, SamplingParams
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk

BLOCK = 16


def cached_config(**kw) -> BatcherConfig:
    return BatcherConfig(**{"kv_block_size": BLOCK, "kv_blocks": 64, "prefill_chunk": 64, "prefix_cache": True, **kw})


def prompt(n: int, start: int = 3) -> list[int]:
    return [(start + 7 * i) % 300 + 2 for i in range(n)]


def test_a_warm_prefill_gives_the_logits_of_a_cold_one(tiny_batch_model):
    decoder = tiny_batch_model.decoder
    tokens = prompt(45)
    cold = decoder.new_store(BLOCK, num_blocks=16)
    cold.add_sequence("cold", 64)
    want = decoder.forward([SeqChunk("cold", tokens)], cold)[0]

    warm = decoder.new_store(BLOCK, num_blocks=16, prefix_cache=True)
    warm.add_sequence("first", 64, tokens)
    decoder.forward([SeqChunk("first", tokens)], warm)
    assert warm.publish("first", tokens) == 2  # the two full blocks of 45 tokens
    warm.free_sequence("first")
    assert warm.peek(tokens) == (2, 2)  # both adoptable, nobody references them now
    warm.add_sequence("second", 64, tokens)
    assert warm.seq_len("second") == 2 * BLOCK  # the prefill starts after the adopted blocks
    got = decoder.forward([SeqChunk("second", tokens[2 * BLOCK:])], warm)[0]
    assert_logits_close(got, want, decoder.config, len(tokens), note="warm against cold")
    assert int(got.argmax()) == int(want.argmax())


def test_a_fully_cached_prompt_still_computes_its_last_token(tiny_batch_model):
    store = tiny_batch_model.decoder.new_store(BLOCK, num_blocks=16, prefix_cache=True)
    tokens = prompt(2 * BLOCK)  # exactly two blocks
    store.add_sequence("a", 40, tokens)
    store.seq("a").length = len(tokens)  # as if its prefill ran
    store.publish("a", tokens)
    store.free_sequence("a")
    store.add_sequence("b", 40, tokens)
    assert store.seq_len("b") == BLOCK  # one block adopted, the second recomputed for its last token


def test_a_repeated_request_adopts_the_published_prefix_and_answers_the_same(tiny_batch_model):
    model = tiny_batch_model
    tokens = prompt(40)
    params = greedy_params(8, ignore_eos=True)
    want = sequential_ids(model, tokens, params)
    with spawn(model, cached_config()) as batcher:
        first = batcher.generate(tokens, params)
        stats = batcher.stats()
        assert stats.prefix_cache_queries == 40 and stats.prefix_cache_hits == 0
        assert stats.kv_blocks_cached == 2  # 40 prompt + 7 fed tokens (the 8th is never fed): two full blocks
        second = batcher.generate(tokens, params)
        stats = batcher.stats()
        assert stats.prefix_cache_hits == 32  # two blocks adopted; the last prompt token is computed
        assert list(first.token_ids) == list(second.token_ids) == want
        assert stats.kv_blocks_free == stats.kv_blocks_total  # cached blocks count as free


def test_a_longer_prompt_extends_a_cached_one_and_answers_as_if_alone(tiny_batch_model):
    model = tiny_batch_model
    base = prompt(35)
    longer = base + prompt(20, start=11)
    params = greedy_params(6, ignore_eos=True)
    with spawn(model, cached_config()) as batcher:
        batcher.generate(base, params)
        result = batcher.generate(longer, params)
        assert batcher.stats().prefix_cache_hits == 32
        assert list(result.token_ids) == sequential_ids(model, longer, params)


def test_a_salted_request_adopts_only_its_own_namespace(tiny_batch_model):
    model = tiny_batch_model
    tokens = prompt(40)
    with spawn(model, cached_config()) as batcher:
        batcher.generate(tokens, GenerationParams(max_tokens=2, cache_salt="alice"))
        batcher.generate(tokens, GenerationParams(max_tokens=2, cache_salt="bob"))
        assert batcher.stats().prefix_cache_hits == 0
        batcher.generate(tokens, GenerationParams(max_tokens=2, cache_salt="alice"))
        assert batcher.stats().prefix_cache_hits == 32


def test_a_failed_request_publishes_nothing_partial(tiny_batch_model, monkeypatch):
    # Failing halfway through its prompt, a request publishes nothing: its prompt was never through. Failing
    # at its first decode step, only the prompt's blocks stay cached (they were published when the prompt was
    # through and are whole); nothing it computed after is offered.
    model = tiny_batch_model
    tokens = prompt(40)
    for fail_at, cached in ((2, 0), (4, 2)):  # prompt chunks of 16: forwards 1-3 are the prompt
        with spawn(model, cached_config(prefill_chunk=16)) as batcher:
            runs = {"forwards": 0}
            decoder = model.decoder
            forward = decoder.forward

            def failing_forward(chunks, store):
                runs["forwards"] += 1
                if runs["forwards"] == fail_at:
                    raise RuntimeError("device lost")
                return forward(chunks, store)

            monkeypatch.setattr(decoder, "forward", failing_forward)
            try:
                batcher.generate(tokens, greedy_params(5))
            except Exception as error:  # noqa: BLE001 - the failure is the point
                assert "device lost" in str(error)
            else:
                raise AssertionError("the forward's failure did not reach the caller")
            monkeypatch.setattr(decoder, "forward", forward)
            stats = batcher.stats()
            assert stats.kv_blocks_cached == cached, fail_at
            assert stats.kv_blocks_free == stats.kv_blocks_total


def test_a_prompt_is_cached_as_soon_as_it_is_through(tiny_batch_model):
    # A second request with the same prompt, sent while the first still decodes, adopts its prompt blocks.
    model = tiny_batch_model
    tokens = prompt(40)
    with spawn(model, cached_config()) as batcher:
        first_chunk = threading.Event()
        results = {}

        def long_one() -> None:
            results["first"] = batcher.generate_streaming(tokens, greedy_params(40, ignore_eos=True), None,
                                                          lambda _t: first_chunk.set())

        thread = threading.Thread(target=long_one)
        thread.start()
        assert first_chunk.wait(30)
        second = batcher.generate(tokens, greedy_params(4, ignore_eos=True))
        thread.join(60)
        assert second.usage.cached_tokens == 32 and results["first"].usage.cached_tokens == 0
        assert list(second.token_ids) == list(results["first"].token_ids[:4])


def test_two_requests_with_the_same_new_prefix_both_finish_correctly(tiny_batch_model):
    model = tiny_batch_model
    tokens = prompt(50)
    params = greedy_params(10, ignore_eos=True)
    want = sequential_ids(model, tokens, params)
    with spawn(model, cached_config(max_prefills_per_tick=4)) as batcher:
        results: list[list[int]] = []
        threads = [threading.Thread(target=lambda: results.append(list(batcher.generate(tokens, params).token_ids)))
                   for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert results == [want, want]
        third = batcher.generate(tokens, params)  # adopts whichever copy was published first
        assert list(third.token_ids) == want
        stats = batcher.stats()
        # 48 for the third; 48 more when the second was admitted after the first's prompt was through (it
        # then adopted it) rather than in the same tick (both computed it, and one copy was published).
        assert stats.prefix_cache_hits in (48, 96) and stats.kv_blocks_free == stats.kv_blocks_total


def test_seeded_sampling_gives_the_same_tokens_warm_or_cold(tiny_batch_model):
    model = tiny_batch_model
    tokens = prompt(40)
    params = GenerationParams(max_tokens=8, sampling=SamplingParams(temperature=0.9, top_p=0.95), seed=123,
                              ignore_eos=True)
    with spawn(model, cached_config()) as batcher:
        cold = batcher.generate(tokens, params)
        warm = batcher.generate(tokens, params)
        assert batcher.stats().prefix_cache_hits == 32
        assert cold.token_ids == warm.token_ids


def warmed_worker(model, tokens: list[int]):
    """A worker (one request at a time, driven by hand) whose prefix cache holds `tokens`' full blocks."""
    from worker_helpers import make_request, make_worker

    worker = make_worker(model, cached_config(max_seqs=1))
    first, _ = make_request(worker, tokens, greedy_params(1))
    worker.jobs.put(first)
    worker.tick()
    while not worker.scheduler.idle:
        worker.tick()
    return worker


def test_an_already_cached_prompt_is_admitted_ahead_of_a_cold_one(tiny_batch_model):
    from worker_helpers import drain_reply, make_request

    warm_prompt = prompt(40)
    worker = warmed_worker(tiny_batch_model, warm_prompt)
    scheduler = worker.scheduler
    cold, cold_reply = make_request(worker, prompt(40, start=101), greedy_params(2))
    warm, warm_reply = make_request(worker, warm_prompt, greedy_params(2))
    worker.jobs.put(cold)
    worker.jobs.put(warm)
    worker.tick()
    assert list(scheduler.prefilling) + scheduler.decoding == [warm]  # the cached one goes first
    assert cold.skips == 1 and list(scheduler.waiting) == [cold]
    while not scheduler.idle:
        worker.tick()
    assert drain_reply(warm_reply)[1][0].usage.cached_tokens == 32
    assert drain_reply(cold_reply)[1][0].usage.cached_tokens == 0


def test_a_request_passed_over_four_times_is_admitted_next(tiny_batch_model):
    from worker_helpers import make_request

    warm_prompt = prompt(40)
    worker = warmed_worker(tiny_batch_model, warm_prompt)
    scheduler = worker.scheduler
    cold, _ = make_request(worker, prompt(40, start=101), greedy_params(1))
    worker.jobs.put(cold)
    order = []
    for _ in range(5):  # a warm request keeps arriving behind the cold one
        warm, _ = make_request(worker, warm_prompt, greedy_params(1))
        worker.jobs.put(warm)
        worker.tick()
        order.append("cold" if cold in scheduler.admitted() or cold.seq_id is not None else "warm")
        while scheduler.admitted():
            worker.tick()
    assert order == ["warm", "warm", "warm", "warm", "cold"]
