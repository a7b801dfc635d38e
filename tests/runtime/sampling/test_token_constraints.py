"""What a row may sample: `allowed_token_ids`, `bad_words` and `min_tokens`' held stop ids, in the sampler.

Pins (property tests over random logits and batches): a row with an allowed list only ever samples from
it, and its choice among them is the argmax (or the draw) over those ids alone; a one-token bad word is
never sampled; a longer one's last token is banned exactly when the row's generated tokens end with the
rest of it, and never because of the prompt; held ids are banned for the first `hold_for` tokens and free
after; rows without any of these in the same batch sample exactly what they sample alone. The tokenizing
of bad words follows vLLM (the word as it stands and with a leading space, where that is another spelling
of the same length).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.errors import InvalidRequest, TokenOutOfVocab
from ferrox_batch.generation_types import GenerationParams, SamplingParams
from ferrox_batch.runtime.sampling.sampler import BatchSampler
from ferrox_batch.token_constraints import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, bad_words_ids

VOCAB = 40


def logits_for(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), allowed=st.sets(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
       temperature=st.sampled_from([0.0, 1.0]))
def test_allowed_ids_alone_are_sampled_and_the_greedy_pick_is_their_argmax(seed, allowed, temperature):
    sampler = BatchSampler(VOCAB, "cpu")
    params = SamplingParams(temperature=temperature, allowed_token_ids=tuple(sorted(allowed)))
    row = sampler.new_row(params, seed, [1, 2])
    free = sampler.new_row(SamplingParams(), None, [1, 2])
    x = logits_for(seed, 2)
    token, other = sampler.sample(x, [row, free])
    assert token in allowed
    assert other == int(x[1].argmax())  # the neighbour without a list is untouched
    if temperature == 0.0:
        ids = sorted(allowed)
        assert token == ids[int(x[0, ids].argmax())]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), word=st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=4),
       steps=st.integers(1, 12))
def test_a_longer_bad_words_last_token_is_banned_after_the_rest_of_it(seed, word, steps):
    sampler = BatchSampler(VOCAB, "cpu")
    prefix, last = tuple(word[:-1]), word[-1]
    row = sampler.new_row(SamplingParams(bad_words_ids=(tuple(word),)), None, list(prefix))  # the prompt ends with it
    gen = torch.Generator().manual_seed(seed)
    generated: list[int] = []
    for step in range(steps):
        x = torch.randn(1, VOCAB, generator=gen)
        # Push the row towards the word: the prefix's next token, or the last one, is made the argmax.
        at = len(generated) % len(word)
        x[0, word[at]] += 50
        banned = len(generated) >= len(prefix) and tuple(generated[len(generated) - len(prefix):]) == prefix
        token = sampler.sample(x, [row])[0]
        if banned:
            assert token != last
            expected = x[0].clone()
            expected[last] = float("-inf")
            assert token == int(expected.argmax())
        else:
            assert token == int(x[0].argmax())  # the prompt never counts as the word's beginning
        generated.append(token)


def test_a_one_token_bad_word_is_never_sampled():
    sampler = BatchSampler(VOCAB, "cpu")
    x = torch.zeros(1, VOCAB)
    x[0, 7] = 10
    row = sampler.new_row(SamplingParams(bad_words_ids=((7,),)), None, [])
    assert [sampler.sample(x, [row])[0] for _ in range(3)] == [int(x[0, :7].argmax())] * 3


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), held=st.sets(st.integers(0, VOCAB - 1), min_size=1, max_size=3),
       hold_for=st.integers(1, 5))
def test_held_ids_are_banned_for_the_first_tokens_only(seed, held, hold_for):
    sampler = BatchSampler(VOCAB, "cpu")
    row = sampler.new_row(SamplingParams(), None, [], held=sorted(held) + [VOCAB + 5], hold_for=hold_for)
    gen = torch.Generator().manual_seed(seed)
    for step in range(hold_for + 2):
        x = torch.randn(1, VOCAB, generator=gen)
        x[0, min(held)] += 50  # a held id is the argmax every step
        token = sampler.sample(x, [row])[0]
        assert (token not in held) if step < hold_for else token == min(held)


def test_ids_outside_the_vocabulary_fail_the_row_at_admission():
    sampler = BatchSampler(VOCAB, "cpu")
    for params in (SamplingParams(allowed_token_ids=(1, VOCAB)), SamplingParams(bad_words_ids=((2, VOCAB),))):
        with pytest.raises(TokenOutOfVocab):
            sampler.new_row(params, None, [])


class Spelling:
    """An encoder where a leading space is its own token (id 0) unless the word is in `merged`."""

    def __init__(self, merged: dict[str, list[int]]) -> None:
        self.merged = merged

    def __call__(self, text: str) -> list[int]:
        if text in self.merged:
            return self.merged[text]
        out = [0] if text.startswith(" ") else []
        return out + [ord(c) for c in text.lstrip(" ")]


def test_bad_words_take_vllms_two_spellings():
    encode = Spelling({" hi": [500, 105]})
    assert bad_words_ids(["hi"], encode) == ((104, 105), (500, 105))  # the spaced spelling differs, same length
    assert bad_words_ids(["  ok"], encode) == ((111, 107),)  # " ok" is three tokens: only the plain one
    assert bad_words_ids(["a", "a"], encode) == ((97,),)


@pytest.mark.parametrize("words, message", [
    (["w"] * (MAX_BAD_WORDS + 1), "at most"), (["  "], "non-empty"), ([3], "non-empty"),
    (["x" * 200], "at most"), (["y" * (MAX_BAD_WORD_TOKENS + 1)], "tokens"),
])
def test_bad_words_are_bounded_before_and_after_tokenizing(words, message):
    with pytest.raises(InvalidRequest, match=message):
        bad_words_ids(words, Spelling({}))


@pytest.mark.parametrize("fields, name", [
    ({"min_tokens": 5}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": True}, "min_tokens"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
])
def test_generation_params_refuse_bad_extra_fields(fields, name):
    with pytest.raises(InvalidRequest) as refused:
        GenerationParams(max_tokens=4, **fields)
    assert refused.value.param == name


def test_sampling_params_refuse_bad_lists():
    for fields, name in (({"allowed_token_ids": ()}, "allowed_token_ids"),
                         ({"allowed_token_ids": (1, -2)}, "allowed_token_ids"),
                         ({"bad_words_ids": ((),)}, "bad_words"),
                         ({"bad_words_ids": ((1, True),)}, "bad_words")):
        with pytest.raises(InvalidRequest) as refused:
            SamplingParams(**fields)
        assert refused.value.param == name


def test_a_row_left_with_no_token_is_refused_and_its_neighbour_is_not():
    from ferrox_batch.runtime.sampling.sampler_rows import NoTokenLeft

    sampler = BatchSampler(VOCAB, "cpu")
    boxed = sampler.new_row(SamplingParams(allowed_token_ids=(3, 4), bad_words_ids=((3, 3), (3, 4))), None, [])
    free = sampler.new_row(SamplingParams(), None, [])
    x = torch.zeros(2, VOCAB)
    x[:, 3] = 5.0
    assert sampler.sample(x, [boxed, free]) == [3, 3]
    refused, fine = sampler.sample(x, [boxed, free])  # after 3, both 3 and 4 end a bad word
    assert isinstance(refused, NoTokenLeft) and refused.http_status == 400 and fine == 3
