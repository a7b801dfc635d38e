"""`logit_bias` over HTTP and in the batched sampler.

Pins: +100 on one token makes greedy decoding pick it every step, through the `openai` client on both
endpoints; -100 on the token a greedy answer starts with moves it elsewhere; in one batch, only the rows
that carry a bias are moved (the sampler adds every row's bias in one op); a token id outside the
vocabulary or a value outside [-100, 100] is a 400 naming `logit_bias`, and so is a key of thousands of digits
(never read as an integer: Python refuses to convert one); the reported log-probabilities stay the model's
own, before the bias.
"""

from __future__ import annotations

import openai
import pytest
import torch
from server_helpers import GREEDY, MODEL_NAME, openai_client

from ferrox_batch.errors import TokenOutOfVocab
from ferrox_batch.generation_types import SamplingParams
from ferrox_batch.runtime.sampling.sampler import BatchSampler

MESSAGES = [{"role": "user", "content": "Say something."}]


def test_a_bias_forces_or_bans_tokens_on_both_endpoints(server):
    base_url, batcher = server
    forced = 77
    with openai_client(base_url) as client:
        reply = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=5, logprobs=0,
                                          logit_bias={str(forced): 100}, **GREEDY)
        assert reply.choices[0].logprobs.tokens == [batcher.tokenizer.decode_text([forced])] * 5
        unbiased = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=1, logprobs=0, **GREEDY)
        first = batcher.tokenizer.encode(unbiased.choices[0].text, add_special_tokens=False)[0]
        banned = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=1, logprobs=0,
                                           logit_bias={str(first): -100}, **GREEDY)
        assert banned.choices[0].logprobs.tokens != unbiased.choices[0].logprobs.tokens
        chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, logprobs=True,
                                              logit_bias={str(forced): 100}, **GREEDY)
        content = chat.choices[0].logprobs.content
        assert [e.token for e in content] == [batcher.tokenizer.decode_text([forced])] * 3
        # The model's log-probability of the forced token, not the biased distribution's (which is ~0).
        assert all(e.logprob < -1e-3 for e in content)
        for bias in ({"5": 101}, {"5": "x"}, {"x": 1}, {str(10**9): 1}, {"-3": 1}, [5]):
            with pytest.raises(openai.BadRequestError) as bad:
                client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=1, logit_bias=bias, **GREEDY)
            assert bad.value.param == "logit_bias", bias


@pytest.mark.parametrize("key", ["9" * 5000, "1" + "0" * 30, "0" * 5000 + "5"])
def test_a_key_of_thousands_of_digits_is_a_400_naming_logit_bias(server, key):
    base_url, batcher = server
    with openai_client(base_url) as client:
        for create, body in ((client.completions.create, {"prompt": "Hello"}),
                             (client.chat.completions.create, {"messages": MESSAGES})):
            with pytest.raises(openai.BadRequestError) as bad:
                create(model=MODEL_NAME, max_tokens=1, logit_bias={key: 1}, **body, **GREEDY)
            assert bad.value.param == "logit_bias" and "digits" in bad.value.message, bad.value.message
    assert batcher.stats().worker_alive


def test_only_biased_rows_move_in_a_batch(tiny_batch_model):
    vocab = tiny_batch_model.config.vocab_size
    sampler = BatchSampler(vocab, "cpu")
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    plain = sampler.new_row(SamplingParams(), None, [])
    rows = [plain, sampler.new_row(SamplingParams(logit_bias={9: 100.0}), None, []), plain,
            sampler.new_row(SamplingParams(logit_bias={int(logits[3].argmax()): -100.0}), None, [])]
    out = sampler.sample(logits, rows)
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert out[1] == 9 and out[3] != int(logits[3].argmax())
    with pytest.raises(TokenOutOfVocab):
        sampler.new_row(SamplingParams(logit_bias={vocab: 1.0}), None, [])
