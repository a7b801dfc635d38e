"""Speculative decoding by prompt lookup: the same answers in fewer steps.

Pins, on a tiny checkpoint in float32 (whose continuations repeat, so drafts are found and accepted):
every request answers exactly what it answers without speculation, token for token and text for text,
greedy and sampled with a seed, with penalties, `logit_bias`, bad words, `min_tokens`, log-probabilities,
a grammar, stop strings and stop ids, and `max_tokens` falling anywhere inside a draft; drafts are
counted and accepted, and the steps are fewer; streamed chunks still add up to the text; a request
cancelled while it drafts gives every block back; a model with sliding-window layers decodes without
drafts. (The 64-thread storm runs with speculation on too: `scheduler/test_invariants`.)
"""

from __future__ import annotations

import threading
from collections import Counter

import chi_square
import pytest
import torch
from numerics import logits_tolerance
from tiny_checkpoint import write_tiny_checkpoint

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.generation_types import GenerationParams, SamplingParams
from ferrox_batch.runtime.loading.loader import load_model
from ferrox_batch.structured import StructuredOutput

#: A bound on the tiny checkpoint's logits' magnitude (checked below), which scales their rounding.
LOGIT_SCALE = 50.0
PROMPTS = ["abc abc abc abc abc abc abc abc", "The cat sat on the mat. The cat sat on the", "x y z"]


def batcher(model, k: int, **config) -> ContinuousBatcher:
    return ContinuousBatcher.from_model(model, BatcherConfig(kv_block_size=8, kv_blocks=256, speculative=k > 0,
                                                             speculative_tokens=max(k, 1),
                                                             speculative_ngram_min=1, **config))


def answers(model, k: int, params: list[GenerationParams]) -> tuple[list, object]:
    with batcher(model, k) as b:
        out = []
        for prompt in PROMPTS:
            ids = model.tokenizer.encode(prompt)
            out += [b.generate(ids, p) for p in params]
        stats = b.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total and b.store.seq_ids() == []
    return out, stats


PARAMS = [
    GenerationParams(max_tokens=40, ignore_eos=True),
    GenerationParams(max_tokens=30, ignore_eos=True, sampling=SamplingParams(temperature=0.9, top_k=20), seed=4),
    GenerationParams(max_tokens=30, ignore_eos=True, sampling=SamplingParams(repetition_penalty=1.2,
                                                                             logit_bias=((8, 3.0),))),
    GenerationParams(max_tokens=30, ignore_eos=True, logprobs=2, min_tokens=5, stop_token_ids=(8,)),
    GenerationParams(max_tokens=30, ignore_eos=True, sampling=SamplingParams(bad_words_ids=((8, 8),))),
    GenerationParams(max_tokens=30, stop=("ab", "at")),
    # Greedy rows whose samples depend on nothing sampled before: their positions are verified in one call.
    GenerationParams(max_tokens=30, ignore_eos=True, logprobs=3, sampling=SamplingParams(logit_bias=((8, 2.0),))),
]


def test_answers_are_the_same_with_and_without_drafts_in_fewer_steps(tiny_batch_model):
    plain, plain_stats = answers(tiny_batch_model, 0, PARAMS)
    drafted, stats = answers(tiny_batch_model, 4, PARAMS)
    for a, b in zip(plain, drafted):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.usage.completion_tokens == b.usage.completion_tokens
        if a.logprobs is not None:  # a drafted position's logits come from a chunk: two float32 forwards
            tolerance = 2 * logits_tolerance(tiny_batch_model.config, 64, torch.tensor([LOGIT_SCALE]))
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.token == y.token and [t for t, _ in x.top] == [t for t, _ in y.top]
                assert abs(x.logprob - y.logprob) <= tolerance
    assert stats.spec_decode_num_drafts > 0 and 0 < stats.spec_decode_num_accepted_tokens
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.decode_steps + stats.spec_decode_num_accepted_tokens == plain_stats.decode_steps


def test_a_plain_greedy_rows_draft_is_verified_in_one_sampling_call(tiny_batch_model, monkeypatch):
    from ferrox_batch.runtime.sampling.sampler import BatchSampler

    calls = []
    sample = BatchSampler.sample
    monkeypatch.setattr(BatchSampler, "sample", lambda self, logits, rows, *a: calls.append(len(rows)) or
                        sample(self, logits, rows, *a))
    with batcher(tiny_batch_model, 6) as b:
        b.generate(tiny_batch_model.tokenizer.encode(PROMPTS[0]), GenerationParams(max_tokens=200, ignore_eos=True))
        stats = b.stats()
    # Each step samples its row once (the prompt's step too) and, when the draft's first token was kept, its
    # other positions in one more call; drafts kept two tokens or more, where a position by position loop
    # would have called once per position.
    kept_first, kept_second = stats.spec_decode_num_accepted_tokens_per_pos[:2]
    assert kept_second > 0
    assert len(calls) == stats.decode_steps + 1 + kept_first


@pytest.mark.parametrize("max_tokens", range(1, 14))
def test_max_tokens_anywhere_inside_a_draft(tiny_batch_model, max_tokens):
    ids = tiny_batch_model.tokenizer.encode(PROMPTS[0])
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True)
    with batcher(tiny_batch_model, 0) as plain, batcher(tiny_batch_model, 6) as drafted:
        assert plain.generate(ids, params).token_ids == drafted.generate(ids, params).token_ids


def test_a_grammar_row_and_concurrent_rows_answer_the_same(tiny_batch_model):
    spec = StructuredOutput.regex("(ab ){2,6}c")
    requests = [(p, GenerationParams(max_tokens=24, ignore_eos=i != 0, structured=spec if i == 0 else None))
                for i, p in enumerate(PROMPTS)]
    results = {}
    for k in (0, 4):
        with batcher(tiny_batch_model, k) as b:
            out: list = [None] * len(requests)

            def one(i: int) -> None:
                prompt, params = requests[i]
                out[i] = b.generate(tiny_batch_model.tokenizer.encode(prompt), params)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            results[k] = [(r.token_ids, r.text) for r in out]
    assert results[0] == results[4]


def test_streamed_chunks_add_up_and_a_cancel_mid_draft_frees_every_block(tiny_batch_model):
    from ferrox_batch.cancel import CancelToken

    ids = tiny_batch_model.tokenizer.encode(PROMPTS[0])
    with batcher(tiny_batch_model, 4) as b:
        pieces: list[str] = []
        result = b.generate_streaming(ids, GenerationParams(max_tokens=40, ignore_eos=True),
                                      b.tokenizer.stop_tokens, pieces.append)
        assert "".join(pieces) == result.text
        token = CancelToken()
        seen: list[str] = []

        def cancel_on_third(text: str) -> None:
            seen.append(text)
            if len(seen) == 3:
                token.cancel()

        cancelled = b.generate_streaming(ids, GenerationParams(max_tokens=200, ignore_eos=True, cancel=token),
                                         b.tokenizer.stop_tokens, cancel_on_third)
        assert cancelled.finish_reason.kind == "cancelled"
        stats = b.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total and b.store.seq_ids() == []
        assert stats.spec_decode_num_drafts > 0


def test_a_sliding_window_model_decodes_without_drafts(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "window", arch="mistral", tie=False, std=0.15, seed=9,
                                   sliding_window=8)
    model = load_model(folder, device="cpu", dtype="float32")
    with batcher(model, 4) as b:
        b.generate(model.tokenizer.encode(PROMPTS[0]), GenerationParams(max_tokens=20, ignore_eos=True))
        assert b.stats().spec_decode_num_drafts == 0


def test_the_logit_scale_bound_holds(tiny_batch_model):
    from ferrox_batch.runtime.kv.batch_inputs import SeqChunk

    for prompt in PROMPTS:
        ids = tiny_batch_model.tokenizer.encode(prompt)
        store = tiny_batch_model.decoder.new_store(8, num_blocks=16)
        store.add_sequence(0, len(ids))
        _, (every,) = tiny_batch_model.decoder.forward_every([SeqChunk(0, ids)], store, [0])
        assert float(every.abs().max()) <= LOGIT_SCALE


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_the_real_model_answers_the_same_with_drafts(real_model_dir, device, dtype):
    """The default model, in the precision a server picks and in float32: a code edit that copies its
    input, a prompt that does not, and a raw continuation, with stop strings and `max_tokens` that land
    inside drafts, greedy, token for token. A drafted position is computed as a decode query of its own
    (`SeqChunk.as_decodes`), so where the linears are batch-invariant the answers are identical. Elsewhere
    (float32's oneDNN matmul rounds a row differently in a wider batch) they may part where two tokens
    tie to float32's rounding: there the tie is checked to be one."""
    import dataclasses

    from ferrox_batch.runtime.kv.batch_inputs import SeqChunk

    model = load_model(real_model_dir, device=device, dtype=dtype)
    code = ("def total(items):\n    result = 0\n    for item in items:\n        result += item.price * item.count\n"
            "    return result\n")
    prompts = [model.tokenizer.encode_chat([{"role": "user", "content": "Rename result to acc and reply with the "
                                             "full code only:\n\n" + code}]),
               model.tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}]),
               model.tokenizer.encode(code + code[:40])]
    params = [GenerationParams(max_tokens=96), GenerationParams(max_tokens=17),
              GenerationParams(max_tokens=60, stop=("count",))]
    jobs = [(p, q) for p in prompts for q in params]
    results = {}
    for speculative in (False, True):
        config = dataclasses.replace(BatcherConfig.serving(), speculative=speculative, kv_blocks=256)
        with ContinuousBatcher.from_model(model, config) as b:
            results[speculative] = [b.generate(p, q) for p, q in jobs]
            if speculative:
                assert b.stats().spec_decode_num_accepted_tokens > 0
    for (prompt, _), plain, drafted in zip(jobs, results[False], results[True]):
        if model.batch_invariant or plain.token_ids == drafted.token_ids:
            assert (plain.token_ids, plain.text, plain.finish_reason) == \
                (drafted.token_ids, drafted.text, drafted.finish_reason)
            continue
        at = next(i for i, (x, y) in enumerate(zip(plain.token_ids, drafted.token_ids)) if x != y)
        ids = prompt + list(plain.token_ids[:at])
        store = model.decoder.new_store(16, num_blocks=64)
        store.add_sequence(0, len(ids))
        logits = model.decoder.forward([SeqChunk(0, ids)], store)[0]
        top = logits.topk(2).values
        assert float(top[0] - top[1]) <= 2 * logits_tolerance(model.config, len(ids), logits), (at, plain.text)


class Recorder:
    """A reply sink that keeps every chunk's text and token ids, and the final outcome."""

    def __init__(self) -> None:
        self.chunks: list[tuple[str, tuple[int, ...]]] = []
        self.outcome = None
        self.done = threading.Event()

    def chunk(self, text: str, logprobs=(), token_ids: tuple[int, ...] = ()) -> None:
        self.chunks.append((text, token_ids))

    def finished(self, outcome) -> None:
        self.outcome = outcome
        self.done.set()


def test_a_verified_drafts_tokens_stream_as_one_chunk(tiny_batch_model):
    ids = tiny_batch_model.tokenizer.encode(PROMPTS[0])
    params = GenerationParams(max_tokens=150, ignore_eos=True, stream_token_ids=True)  # it ends in a loop
    with batcher(tiny_batch_model, 4) as b:
        sink = Recorder()
        b.submit(ids, params, sink=sink)
        assert sink.done.wait(60)
        stats = b.stats()
    result = sink.outcome
    assert "".join(text for text, _ in sink.chunks) == result.text
    assert tuple(t for _, ids in sink.chunks for t in ids) == result.token_ids
    # At most one chunk per step: the first token's, then each decode step's (a draft's accepted tokens
    # with the one after them, or one token; a token ending inside a character goes out with the next).
    assert len(sink.chunks) <= 1 + stats.decode_steps < len(result.token_ids)
    assert max(len(ids) for _, ids in sink.chunks) == 5  # a whole draft of 4 and the token after it


class HookedDecoder:
    """The real decoder, with `hook` called after each forward that returns every position's logits (a
    step with a drafted row)."""

    def __init__(self, inner, hook) -> None:
        self.inner = inner
        self.hook = hook

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def forward_every(self, chunks, store, rows):
        out = self.inner.forward_every(chunks, store, rows)
        self.hook()
        return out


class Crash(BaseException):
    """Not an `Exception`: it takes the worker down."""


def hooked_batcher(model, hook) -> ContinuousBatcher:
    config = BatcherConfig(kv_block_size=8, kv_blocks=256, speculative=True, speculative_ngram_min=1)
    return ContinuousBatcher.spawn_with_config(HookedDecoder(model.decoder, hook), model.tokenizer.decode, config)


def test_a_deadline_passing_mid_draft_frees_every_block(tiny_batch_model):
    from ferrox_batch.errors import WaitTimedOut

    ids = tiny_batch_model.tokenizer.encode(PROMPTS[0])
    slow = threading.Event()
    with hooked_batcher(tiny_batch_model, lambda: slow.wait(0.5)) as b:
        with pytest.raises(WaitTimedOut):
            b.generate(ids, GenerationParams(max_tokens=200, ignore_eos=True), timeout=0.3)
        slow.set()
        for _ in range(600):  # the cancel lands at the worker's next step
            stats = b.stats()
            if stats.kv_blocks_free == stats.kv_blocks_total and not b.store.seq_ids():
                break
            threading.Event().wait(0.05)
        assert stats.kv_blocks_free == stats.kv_blocks_total and b.store.seq_ids() == []
        assert stats.spec_decode_num_drafts > 0
        assert b.generate(ids, GenerationParams(max_tokens=5, ignore_eos=True)).usage.completion_tokens == 5


def test_a_worker_dying_mid_draft_answers_and_frees_every_block(tiny_batch_model):
    from ferrox_batch.errors import WorkerDied

    def crash() -> None:
        raise Crash("injected crash in a drafted step")

    ids = tiny_batch_model.tokenizer.encode(PROMPTS[0])
    b = hooked_batcher(tiny_batch_model, crash)
    try:
        with pytest.raises(WorkerDied, match="Crash"):
            b.generate(ids, GenerationParams(max_tokens=50, ignore_eos=True), timeout=60)
        stats = b.stats()
        assert not stats.worker_alive and stats.kv_blocks_free == stats.kv_blocks_total
    finally:
        assert b.close(timeout=10)


#: The statistical test's level: a sampler that keeps the model's distribution fails it with this chance.
SIGNIFICANCE = 0.001
SAMPLES = 2000


def sampled_outputs(model, k: int, first_seed: int) -> tuple[Counter, object]:
    """`SAMPLES` outputs of 5 tokens after a prompt that repeats token 8, sampled at temperature 1 with
    filters, a presence penalty and a bias towards 8 that makes the drafts (runs of 8) about as often
    accepted as not, each request with its own seed; all in one wide batch that drafts."""
    sampling = SamplingParams(temperature=1.0, top_k=40, presence_penalty=0.5, logit_bias=((8, 9.5),))
    # Each wave of 256 prompts prefills in one step, so the steps after it decode (and draft) alone.
    config = BatcherConfig(kv_block_size=8, kv_blocks=4096, max_seqs=256, max_queue=SAMPLES, max_batch_tokens=4096,
                           max_prefills_per_tick=256, speculative=k > 0, speculative_tokens=max(k, 1),
                           speculative_ngram_min=1, speculative_max_batch=256)
    # The worker's forwards wait until every request is queued: how fast the caller's thread submits (which
    # varies with the machine's load) then decides nothing, and every wave after the first is whole.
    gate = threading.Event()
    with ContinuousBatcher.spawn_with_config(GatedDecoder(model.decoder, gate), model.tokenizer.decode, config) as b:
        try:
            tickets = [b.submit([8] * 10, GenerationParams(max_tokens=5, ignore_eos=True, sampling=sampling,
                                                           seed=first_seed + i)) for i in range(SAMPLES)]
        finally:
            gate.set()
        outputs = Counter(t.wait(timeout=120).token_ids for t in tickets)
        return outputs, b.stats()


class GatedDecoder:
    """The real decoder, whose forwards wait for `gate`."""

    def __init__(self, inner, gate: threading.Event) -> None:
        self.inner = inner
        self.gate = gate

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if not (name.startswith("forward") and callable(attr)):
            return attr

        def gated(*args, **kwargs):
            self.gate.wait()
            return attr(*args, **kwargs)

        return gated


def test_sampled_outputs_keep_the_models_distribution(tiny_batch_model):
    """Two samples of `SAMPLES` outputs, without speculation and with it (other seeds), are one distribution
    by Pearson's two-sample chi-square test at `SIGNIFICANCE`; the same test tells a verifier that keeps
    every draft token apart from the model. Seeds fix both samples, so the outcome is the same on every run
    of one machine."""
    plain, _ = sampled_outputs(tiny_batch_model, 0, 0)
    drafted, stats = sampled_outputs(tiny_batch_model, 4, SAMPLES)
    accepted = stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_drafts >= SAMPLES // 4 and 0.2 < accepted < 0.9, stats
    statistic, df, p = chi_square.two_sample(plain, drafted)
    assert df >= 10 and p > SIGNIFICANCE, (statistic, df, p)


def test_the_distribution_test_tells_a_biased_verifier_apart(tiny_batch_model, monkeypatch):
    from ferrox_batch.runtime.runner import ModelRunner

    def keep_every_draft_token(self, sampling, drafted, spans, sampled) -> None:
        for i in drafted:
            draft = sampling[i].draft
            row = self._samplers[sampling[i].seq_id]
            sampled[i] = (*draft, self.sampler.sample(spans[sampling[i].row][len(draft)][None], [row])[0])

    plain, _ = sampled_outputs(tiny_batch_model, 0, 0)
    monkeypatch.setattr(ModelRunner, "_verify", keep_every_draft_token)
    biased, _ = sampled_outputs(tiny_batch_model, 4, SAMPLES)
    _, _, p = chi_square.two_sample(plain, biased)
    assert p < SIGNIFICANCE, p
