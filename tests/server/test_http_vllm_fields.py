"""OpenAI's four prompt forms and vLLM's extra request fields over HTTP, through the official `openai` client.

Pins: a completion's several prompts (strings, or token-id lists) answer one choice per prompt and `n`,
numbered prompt by prompt, each what the prompt gets alone, whole and streamed, with the prompts' tokens
summed in the usage; `stop_token_ids` ends the output on an id; `min_tokens` holds back the stop ids and
stop strings until it is reached; `include_stop_str_in_output` keeps the stop's text; `allowed_token_ids`
and `bad_words` bound what is sampled; `skip_special_tokens: false` keeps special tokens' text;
`truncate_prompt_tokens` keeps a prompt's last k tokens; `prompt_logprobs` is vLLM's shape on both
endpoints; `return_token_ids` reports the prompt's and the output's ids, whole and streamed, the streamed
deltas adding up to the whole. (Bad values are 400s naming the field: `test_errors`.)
"""

from __future__ import annotations


import pytest
from server_helpers import GREEDY, MODEL_NAME

PROMPTS = ["Once upon a time", "The quick brown fox jumps", "In a hole in the ground"]


def greedy(client, prompt, max_tokens=8, **extra):
    body = {**GREEDY["extra_body"], **extra}
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                     extra_body=body)


def test_several_string_prompts_answer_each_alone_with_n_choices(client, tiny_batch_model):
    alone = [greedy(client, p).choices[0].text for p in PROMPTS]
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=8, n=2, temperature=0.0,
                                      extra_body=GREEDY["extra_body"])
    assert [c.index for c in reply.choices] == list(range(6))
    assert [c.text for c in reply.choices] == [t for t in alone for _ in range(2)]  # choice i*n + j
    tokens = sum(len(tiny_batch_model.tokenizer.encode(p)) for p in PROMPTS)
    assert reply.usage.prompt_tokens == tokens and reply.usage.completion_tokens == 6 * 8


def test_token_id_prompts_as_an_eval_harness_sends_them(client, tiny_batch_model):
    ids = [tiny_batch_model.tokenizer.encode(p) for p in PROMPTS]
    as_text = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=1,
                                        temperature=0.0)
    as_ids = client.completions.create(model=MODEL_NAME, prompt=[ids[1]], max_tokens=0, echo=True, logprobs=1,
                                       temperature=0.0)
    assert as_ids.choices[0].text == as_text.choices[0].text == PROMPTS[1]
    assert as_ids.choices[0].logprobs.token_logprobs == as_text.choices[0].logprobs.token_logprobs
    several = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                        temperature=0.0)
    assert [c.text for c in several.choices] == PROMPTS
    assert several.choices[1].logprobs.token_logprobs == as_text.choices[0].logprobs.token_logprobs
    flat = client.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=4, temperature=0.0,
                                     extra_body=GREEDY["extra_body"])
    assert flat.choices[0].text == greedy(client, PROMPTS[0], 4).choices[0].text


def test_several_prompts_streamed(client):
    alone = [greedy(client, p, 6).choices[0].text for p in PROMPTS[:2]]
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=6, temperature=0.0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body=GREEDY["extra_body"])
    text, usage = {0: "", 1: ""}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text[choice.index] += choice.text
    assert [text[0], text[1]] == alone
    assert usage is not None and usage.completion_tokens == 12


def test_best_of_ranks_within_each_prompt(client):
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=4, n=1, best_of=3, seed=5,
                                      temperature=1.0, logprobs=0, extra_body=GREEDY["extra_body"])
    assert len(reply.choices) == 2 and reply.usage.completion_tokens == 2 * 3 * 4
    for p, choice in enumerate(reply.choices):
        candidates = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[p], max_tokens=4, n=3, seed=5,
                                               temperature=1.0, logprobs=0, extra_body=GREEDY["extra_body"])
        scores = [sum(c.logprobs.token_logprobs) for c in candidates.choices]
        assert sum(choice.logprobs.token_logprobs) == max(scores)


def ids_of(client, prompt, max_tokens=8, **extra):
    reply = greedy(client, prompt, max_tokens, return_token_ids=True, **extra)
    return reply.choices[0], reply.choices[0].model_extra["token_ids"]


def test_stop_token_ids_end_the_output_on_an_id(client):
    _, ids = ids_of(client, PROMPTS[0])
    choice, stopped = ids_of(client, PROMPTS[0], stop_token_ids=[ids[3]], ignore_eos=False)
    first = ids.index(ids[3])
    assert choice.finish_reason == "stop" and stopped == ids[:first + 1]  # the stop id is reported last


def letters(tokenizer) -> list[int]:
    """Ids of single ASCII letters: output sampled among them is plain text, one character a token."""
    ids = [tokenizer.encode(c, add_special_tokens=False) for c in "abcdefgh"]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def test_min_tokens_holds_back_stop_ids_and_strings(client, tiny_batch_model):
    _, ids = ids_of(client, PROMPTS[0], 3)
    choice, held = ids_of(client, PROMPTS[0], 8, stop_token_ids=[ids[0]], min_tokens=3, ignore_eos=False)
    assert ids[0] not in held[:3] and len(held) >= 3
    allowed = letters(tiny_batch_model.tokenizer)
    plain = greedy(client, PROMPTS[0], 12, allowed_token_ids=allowed).choices[0].text
    stop = plain[0]
    assert greedy(client, PROMPTS[0], 12, allowed_token_ids=allowed, stop=[stop]).choices[0].text == ""
    late = greedy(client, PROMPTS[0], 12, allowed_token_ids=allowed, stop=[stop], min_tokens=2).choices[0].text
    # One character a token: a stop must end in the text of the 3rd token or later.
    again = plain.find(stop, 2)
    assert late == (plain if again < 0 else plain[:again])


def test_include_stop_str_in_output_keeps_the_stop(client, tiny_batch_model):
    allowed = letters(tiny_batch_model.tokenizer)
    plain = greedy(client, PROMPTS[1], 12, allowed_token_ids=allowed).choices[0].text
    stop = plain[3:5]
    cut = plain.index(stop)
    kept = greedy(client, PROMPTS[1], 12, allowed_token_ids=allowed, stop=[stop],
                  include_stop_str_in_output=True).choices[0]
    dropped = greedy(client, PROMPTS[1], 12, allowed_token_ids=allowed, stop=[stop]).choices[0]
    assert dropped.text == plain[:cut] and kept.text == plain[:cut] + stop and kept.finish_reason == "stop"
    one = tiny_batch_model.tokenizer.encode(plain[4], add_special_tokens=False)[0]
    by_id = greedy(client, PROMPTS[1], 12, allowed_token_ids=allowed, stop_token_ids=[one], ignore_eos=False,
                   include_stop_str_in_output=True).choices[0]
    assert by_id.text == plain[:plain.index(plain[4]) + 1]  # the stop token's text is kept too


def test_allowed_token_ids_and_bad_words_bound_what_is_sampled(client, tiny_batch_model):
    allowed = [100, 101, 102, 250]
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=3,
                                      extra_body={"ignore_eos": True, "allowed_token_ids": allowed,
                                                  "return_token_ids": True})
    assert set(reply.choices[0].model_extra["token_ids"]) <= set(allowed)
    letter_ids = letters(tiny_batch_model.tokenizer)
    _, ids = ids_of(client, PROMPTS[2], 10, allowed_token_ids=letter_ids)
    word = tiny_batch_model.tokenizer.decode_text([ids[1]])
    _, banned = ids_of(client, PROMPTS[2], 10, allowed_token_ids=letter_ids, bad_words=[word])
    assert ids[1] not in banned and banned[0] == ids[0] and set(banned) <= set(letter_ids)


def test_skip_special_tokens_false_keeps_their_text(client, tiny_batch_model):
    tokenizer = tiny_batch_model.tokenizer
    special = min(tokenizer.special_texts)
    text = tokenizer.special_texts[special].decode()
    kept = greedy(client, PROMPTS[0], 3, allowed_token_ids=[special], skip_special_tokens=False)
    skipped = greedy(client, PROMPTS[0], 3, allowed_token_ids=[special])
    assert kept.choices[0].text == text * 3 and skipped.choices[0].text == ""
    both = greedy(client, PROMPTS[0], 3, allowed_token_ids=[special], skip_special_tokens=False,
                  spaces_between_special_tokens=False)
    assert both.choices[0].text == text * 3  # no space between added tokens either way


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tiny_batch_model):
    ids = tiny_batch_model.tokenizer.encode(PROMPTS[1])
    cut = greedy(client, PROMPTS[1], 6, truncate_prompt_tokens=3)
    tail = client.completions.create(model=MODEL_NAME, prompt=ids[-3:], max_tokens=6, temperature=0.0,
                                     extra_body=GREEDY["extra_body"])
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == tail.choices[0].text
    whole = greedy(client, PROMPTS[1], 6, truncate_prompt_tokens=-1)  # the context length: nothing cut
    assert whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[1]}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4


def test_prompt_logprobs_in_vllms_shape(client, tiny_batch_model):
    ids = tiny_batch_model.tokenizer.encode(PROMPTS[1])
    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=0)
    reply = greedy(client, PROMPTS[1], 2, prompt_logprobs=2)
    entries = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry, expected in zip(ids[1:], entries[1:], echoed.choices[0].logprobs.token_logprobs[1:]):
        mine = entry[str(token)]
        assert mine["logprob"] == expected  # the same prompt's own forward, uncached: the same arithmetic
        assert mine["rank"] >= 1 and isinstance(mine["decoded_token"], str)
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(token) or v["rank"] <= 2)
        assert ranks[:2] == [1, 2] and 2 <= len(entry) <= 3
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0})
    top = chat.model_extra["prompt_logprobs"]
    assert top[0] is None and all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in top[1:])


def test_return_token_ids_whole_and_streamed(client, tiny_batch_model):
    ids = tiny_batch_model.tokenizer.encode(PROMPTS[0])
    choice, whole = ids_of(client, PROMPTS[0], 8)
    assert choice.model_extra["prompt_token_ids"] == ids and len(whole) == 8
    assert tiny_batch_model.tokenizer.decode_text(whole) == choice.text
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    streamed, prompts = [], []
    for chunk in stream:
        for c in chunk.choices:
            streamed += c.model_extra["token_ids"]
            if c.model_extra.get("prompt_token_ids") is not None:
                prompts.append(c.model_extra["prompt_token_ids"])
    assert streamed == whole and prompts == [ids]
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0.0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    chat_ids = chat.choices[0].model_extra["token_ids"]
    assert chat.model_extra["prompt_token_ids"] == tiny_batch_model.tokenizer.encode_chat(messages)
    assert len(chat_ids) == 5
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0.0,
                                            stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    streamed, prompts = [], []
    for chunk in stream:
        if chunk.model_extra.get("prompt_token_ids") is not None:
            prompts.append(chunk.model_extra["prompt_token_ids"])
        for c in chunk.choices:
            streamed += c.model_extra.get("token_ids") or []
    assert streamed == chat_ids and prompts == [chat.model_extra["prompt_token_ids"]]


@pytest.mark.parametrize("stream", [False, True])
def test_the_stop_token_is_reported_last_in_token_ids(client, stream):
    _, ids = ids_of(client, PROMPTS[2], 6)
    body = {"ignore_eos": False, "stop_token_ids": [ids[2]], "return_token_ids": True}
    if not stream:
        reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=6, temperature=0.0,
                                          extra_body=body)
        got = reply.choices[0].model_extra["token_ids"]
    else:
        got = []
        for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=6, temperature=0.0,
                                               stream=True, extra_body=body):
            for c in chunk.choices:
                got += c.model_extra["token_ids"]
    assert got == ids[:ids.index(ids[2]) + 1]


@pytest.mark.parametrize("extra", [
    {"min_tokens": 3, "stop_token_ids": [100, 101, 102], "ignore_eos": False},
    {"stop": ["a"], "include_stop_str_in_output": True},
    {"bad_words": ["b", "c"]},
    {"allowed_token_ids": [100, 101, 102, 250], "skip_special_tokens": False},
    {"truncate_prompt_tokens": 4, "min_tokens": 2, "stop": ["a"]},
])
@pytest.mark.parametrize("chat", [False, True])
def test_each_field_streams_what_it_answers_whole(client, tiny_batch_model, extra, chat):
    letter_ids = letters(tiny_batch_model.tokenizer)
    body = {"ignore_eos": True, **extra}
    if "allowed_token_ids" not in body:
        body["allowed_token_ids"] = letter_ids  # plain letters: stops and bans meet real text
    if chat:
        messages = [{"role": "user", "content": PROMPTS[1]}]
        whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                               extra_body=body).choices[0].message.content
        stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                                stream=True, extra_body=body)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    else:
        whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                          extra_body=body).choices[0].text
        stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                           stream=True, extra_body=body)
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert streamed == whole


def test_constraints_that_leave_no_token_are_the_requests_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       extra_body={"allowed_token_ids": [0], "guided_regex": "[a-c]{2}"})
    assert refused.value.code == "no_token_left"
    assert client.completions.create(model=MODEL_NAME, prompt="ok", max_tokens=2).choices[0].text is not None
