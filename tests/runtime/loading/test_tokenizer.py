"""The tokenizer wrapper: raw-byte decode, chat templates, stop tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.engine.text import prompt_ids
from ferrox_batch.errors import InvalidRequest
from ferrox_batch.runtime.loading.tokenizer import Tokenizer, byte_level_alphabet
from ferrox_batch.stop_tokens import StopTokens


@pytest.fixture(scope="module")
def tok(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def test_the_byte_level_alphabet_is_a_bijection_onto_all_bytes():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60))
def test_decode_of_encode_returns_the_original_bytes(tok, text):
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text.encode("utf-8")


def test_a_character_can_straddle_two_tokens_and_decode_returns_raw_bytes(tok):
    ids = tok.encode("\U0001f680", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert b"".join(pieces) == "\U0001f680".encode()
    if len(ids) > 1:  # the tiny vocabulary splits the emoji: no piece is valid UTF-8 alone
        with pytest.raises(UnicodeDecodeError):
            pieces[0].decode("utf-8")


def test_special_tokens_decode_to_nothing_and_are_encoded_whole(tok):
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.decode([im_end]) == b""
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [im_end]


def test_decoding_an_id_outside_the_vocabulary_is_a_clear_error(tok):
    with pytest.raises(ValueError, match="outside the tokenizer"):
        tok.decode([10**6])
    with pytest.raises(ValueError, match="outside the tokenizer"):
        tok.decode([-1])


def test_the_chat_template_renders_chatml(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.token_to_id("<|im_start|>")


def test_bad_chat_messages_are_refused_clearly(tok):
    with pytest.raises(ValueError, match="at least one message"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="message 0 needs a string role"):
        tok.apply_chat_template([{"role": "user", "content": 3}])


def test_a_template_that_fails_on_the_messages_is_a_value_error(tiny_llama_dir):
    tok = Tokenizer.from_dir(tiny_llama_dir)
    tok.set_chat_template("{{ messages[0].tools.name }}")  # needs a field these messages lack
    with pytest.raises(ValueError, match="chat template failed on the messages"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequest, match="chat template failed"):  # the library's text path: a 400
        prompt_ids(tok, [{"role": "user", "content": "hi"}])


def test_stop_tokens_are_a_set_of_ids():
    assert StopTokens.from_eos(None).ids == frozenset()
    assert StopTokens.from_eos(7).contains(7) and 7 in StopTokens.from_eos(7)
    assert not StopTokens.default().contains(0)
    with pytest.raises(ValueError):
        StopTokens(frozenset({-1}))


def test_ids_of_a_padded_model_vocabulary_decode_to_nothing(tiny_llama_dir):
    tok = Tokenizer.from_dir(tiny_llama_dir)
    size = tok.vocab_size
    with pytest.raises(ValueError):
        tok.decode([size + 5])
    tok.pad_to(size + 10)
    assert tok.decode([size + 5]) == b""
    with pytest.raises(ValueError):
        tok.decode([size + 10])
