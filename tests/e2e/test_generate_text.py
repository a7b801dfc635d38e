"""The text-level API: prompts and chat messages in, text out, stop strings resolved."""

from __future__ import annotations

import pytest
from batch_helpers import greedy_params, sequential_ids

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.errors import InvalidRequest
from ferrox_batch.generation_types import FinishReason


@pytest.fixture()
def batcher(tiny_batch_model):
    with ContinuousBatcher.from_model(tiny_batch_model, BatcherConfig(kv_block_size=4, kv_blocks=256)) as b:
        yield b


def test_a_plain_prompt_is_tokenized_and_decoded(batcher, tiny_batch_model):
    tok = tiny_batch_model.tokenizer
    result = batcher.generate_text("The quick brown fox", max_tokens=8, ignore_eos=True)
    want = sequential_ids(tiny_batch_model, tok.encode("The quick brown fox"), greedy_params(8, ignore_eos=True))
    assert list(result.token_ids) == want
    assert result.text == tok.decode_text(want)
    assert result.finish_reason == FinishReason.LENGTH


def test_chat_messages_use_the_template_and_stream(batcher, tiny_batch_model):
    chunks: list[str] = []
    messages = [{"role": "user", "content": "hello"}]
    result = batcher.generate_text(messages, max_tokens=6, ignore_eos=True, on_chunk=chunks.append)
    ids = tiny_batch_model.tokenizer.encode_chat(messages)
    assert list(result.token_ids) == sequential_ids(tiny_batch_model, ids, greedy_params(6, ignore_eos=True))
    assert "".join(chunks) == result.text


def test_a_single_token_stop_string_stops_by_id_even_for_a_special_token(batcher, tiny_batch_model):
    tok = tiny_batch_model.tokenizer
    base = batcher.generate_text("Paged attention", max_tokens=10, ignore_eos=True)
    ids = list(base.token_ids)
    # A token whose text encodes back to exactly itself, and appears nowhere earlier (as id or text).
    cut, text = next(
        (i, tok.decode_text([t])) for i, t in enumerate(ids)
        if i > 0 and tok.encode(tok.decode_text([t]), add_special_tokens=False) == [t]
        and tok.decode_text([t]) not in tok.decode_text(ids[:i])
    )
    stopped = batcher.generate_text("Paged attention", max_tokens=10, ignore_eos=True, stop=[text])
    assert list(stopped.token_ids) == ids[:cut]
    assert stopped.finish_reason == FinishReason.STOP  # stopped by id: the token is not part of the output
    from ferrox_batch.engine.text import text_params

    params = text_params(tok, max_tokens=4, stop=["<|im_end|>", "two tokens here"])
    assert tok.token_to_id("<|im_end|>") in params.stop_string_ids and params.stop_token_ids == ()
    assert params.stop == ("<|im_end|>", "two tokens here")


def test_sampling_comes_whole_or_as_fields_never_both(tiny_batch_model):
    from ferrox_batch.engine.text import text_params
    from ferrox_batch.generation_types import SamplingParams

    tok = tiny_batch_model.tokenizer
    whole = SamplingParams(temperature=0.5, top_k=3, frequency_penalty=0.2)
    assert text_params(tok, max_tokens=4, sampling=whole).sampling is whole
    assert text_params(tok, max_tokens=4, temperature=0.5, top_k=3, frequency_penalty=0.2).sampling == whole
    with pytest.raises(TypeError, match="not both"):
        text_params(tok, max_tokens=4, sampling=whole, top_k=5)


def test_bad_text_requests_are_invalid_requests(batcher):
    with pytest.raises(InvalidRequest):
        batcher.generate_text(42)
    with pytest.raises(InvalidRequest, match="at least one message"):
        batcher.generate_text([])
    with pytest.raises(InvalidRequest, match="options"):
        batcher.generate_text("hi", max_tokens=2, temprature=0.5)
    with pytest.raises(InvalidRequest):
        batcher.generate_text("hi", max_tokens=-1)


def test_generate_text_needs_a_tokenizer(tiny_batch_model):
    from batch_helpers import identity_decode

    b = ContinuousBatcher.spawn_with_config(tiny_batch_model.decoder, identity_decode, BatcherConfig())
    try:
        with pytest.raises(ValueError, match="from_model"):
            b.generate_text("hi")
    finally:
        b.close()
