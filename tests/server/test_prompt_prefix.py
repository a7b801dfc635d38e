"""A prompt past the context is refused from a tokenized prefix when the tokenizer gives no length bound
(`prompt_ids.prefix_refusal`), never from a prefix when the whole text fits; and `Tokenizer.encode_within`
counts a text past its limit without building the ids."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.admission.kv import KvElem, KvShape
from ferrox_batch.errors import KvBudgetExceeded
from ferrox_batch.server.prompt_ids import PREFIX_CHARS_PER_POSITION, encode_prompt

LIMIT = 16
WORDS = st.lists(st.sampled_from(["lorem", "ipsum", " ", "\n", "é", "xyzzy", "12", "!"]), max_size=400).map("".join)


@pytest.fixture(scope="module")
def unbounded(tiny_batch_model):
    """The tiny tokenizer, told it has no length bound (as a tokenizer that may merge unbounded input)."""
    tokenizer = copy.copy(tiny_batch_model.tokenizer)
    tokenizer.length_bound = None
    return tokenizer


def ceiling(limit: int) -> ContextCeiling:
    return ContextCeiling(limit, KvShape(1, 1, KvElem.F32))


@settings(max_examples=60, deadline=None)
@given(text=WORDS)
def test_a_prefix_refuses_only_a_text_past_the_context(unbounded, text):
    whole = len(unbounded.encode(text, add_special_tokens=False))
    try:
        ids = encode_prompt(unbounded, text, ceiling(LIMIT), add_special_tokens=False)
    except KvBudgetExceeded:
        assert whole > LIMIT
    else:
        assert ids == unbounded.encode(text, add_special_tokens=False)


def test_a_4_mib_prompt_is_refused_from_a_prefix(unbounded, monkeypatch):
    seen: list[int] = []
    encode_within = type(unbounded).encode_within

    def recording(self, text, most, **keywords):
        seen.append(len(text))
        return encode_within(self, text, most, **keywords)

    monkeypatch.setattr(type(unbounded), "encode_within", recording)
    text = "lorem ipsum dolor sit amet " * (4 * 1024 * 1024 // 27)
    with pytest.raises(KvBudgetExceeded, match="first"):
        encode_prompt(unbounded, text, ceiling(512))
    assert seen and max(seen) <= 4 * PREFIX_CHARS_PER_POSITION * 513  # one prefix, or the next


@settings(max_examples=60, deadline=None)
@given(text=WORDS, most=st.integers(0, 200), special=st.booleans())
def test_encode_within_counts_and_builds_the_ids_only_within_the_limit(tiny_batch_model, text, most, special):
    tokenizer = tiny_batch_model.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=special)
    count, within = tokenizer.encode_within(text, most, add_special_tokens=special)
    if within is None:
        assert len(ids) - 1 <= count <= len(ids) and len(ids) > most and count > most
    else:
        assert within == ids and count == len(ids) <= most
