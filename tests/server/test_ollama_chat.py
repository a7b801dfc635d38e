"""Ollama's `/api/chat` and `/api/generate` through the official `ollama` client, against the OpenAI endpoints.

Pins: a chat answer is the chat endpoint's answer to the same conversation, whole and streamed (the
streamed pieces add up to the whole answer; its counts are the chat usage's); `/api/generate` is a chat of
its `system` and `prompt`, or with `raw` the completion of the prompt as it is; `options` say the sampling
fields they map to (a seeded sampled answer is the OpenAI endpoint's with the same settings), `stop` and
`num_predict` stop the answer, runner-only options are accepted, samplers this engine lacks and unknown
options are 400s naming `options.<name>`, `num_ctx` above the context is a 400; `format` constrains the
output; tools and an earlier call's round trip are rendered as the chat endpoint renders them; the load and
unload requests are answered at once; names match with or without `:latest`, else Ollama's 404; what
cannot be honoured is a 400 naming the field.
"""

from __future__ import annotations

import json

import jsonschema
import ollama
import pytest
from server_helpers import MODEL_NAME, openai_client, served, tiny_batcher
from tiny_checkpoint import TOOLS_TEMPLATE, write_tiny_checkpoint

from ferrox_batch.runtime.loading.loader import load_model

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "num_predict": 10}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
# In the order the client's `Tool` model writes its fields, so both endpoints render the same text of it.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ollama"), tie=False, std=0.15, seed=5,
                                   chat_template=TOOLS_TEMPLATE, max_positions=4096)
    model = load_model(folder, device="cpu", dtype="float32")
    with served(tiny_batcher(model)) as (base_url, _app):
        yield base_url


@pytest.fixture(scope="module")
def client(urls):
    return ollama.Client(host=urls, timeout=60)


@pytest.fixture(scope="module")
def openai(urls):
    with openai_client(urls, timeout=60) as c:
        yield c


def openai_chat(openai, messages, max_tokens=10, **options):
    return openai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                          **({"temperature": 0} | options))


def test_a_chat_answer_is_the_chat_endpoints_answer_whole_and_streamed(client, openai):
    whole = client.chat(model=MODEL_NAME, messages=MESSAGES, options=GREEDY, stream=False)
    want = openai_chat(openai, MESSAGES)
    assert whole.message.role == "assistant" and whole.message.content == want.choices[0].message.content
    assert whole.done and whole.done_reason == ("length" if want.choices[0].finish_reason == "length" else "stop")
    assert whole.prompt_eval_count == want.usage.prompt_tokens and whole.eval_count == want.usage.completion_tokens
    assert whole.model == MODEL_NAME
    parts = list(client.chat(model=f"{MODEL_NAME}:latest", messages=MESSAGES, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].message.content == "" and parts[-1].done_reason == whole.done_reason
    assert parts[-1].eval_count == whole.eval_count and all(p.model == f"{MODEL_NAME}:latest" for p in parts)


def test_generate_is_a_chat_of_system_and_prompt_and_raw_is_the_completion(client, openai):
    templated = client.generate(model=MODEL_NAME, system="Be brief.", prompt="Hello there", options=GREEDY)
    assert templated.response == openai_chat(openai, MESSAGES).choices[0].message.content
    raw = client.generate(model=MODEL_NAME, prompt="The quick brown", raw=True, options=GREEDY)
    completion = openai.completions.create(model=MODEL_NAME, prompt="The quick brown", max_tokens=10, temperature=0)
    assert raw.response == completion.choices[0].text and raw.prompt_eval_count == completion.usage.prompt_tokens
    streamed = list(client.generate(model=MODEL_NAME, prompt="The quick brown", raw=True, options=GREEDY,
                                    stream=True))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done


def test_options_say_the_sampling_fields_they_map_to(client, openai):
    sampled = {"temperature": 0.9, "top_k": 7, "top_p": 0.8, "min_p": 0.02, "repeat_penalty": 1.3, "seed": 11,
               "presence_penalty": 0.5, "frequency_penalty": 0.25}
    got = client.chat(model=MODEL_NAME, messages=MESSAGES, options={**sampled, "num_predict": 12})
    want = openai_chat(openai, MESSAGES, 12, temperature=0.9, top_p=0.8, seed=11, presence_penalty=0.5,
                       frequency_penalty=0.25,
                       extra_body={"top_k": 7, "min_p": 0.02, "repetition_penalty": 1.3})
    assert got.message.content == want.choices[0].message.content
    # Without options, Ollama's defaults (0.8, 40, 0.9) apply: the same answer as saying them.
    defaults = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 3, "num_predict": 12}
    said = client.chat(model=MODEL_NAME, messages=MESSAGES, options=defaults)
    unsaid = client.chat(model=MODEL_NAME, messages=MESSAGES, options={"seed": 3, "num_predict": 12})
    assert said.message.content == unsaid.message.content


def test_stop_and_num_predict_end_the_answer(client):
    whole = client.chat(model=MODEL_NAME, messages=MESSAGES, options={"temperature": 0, "num_predict": 16})
    text = whole.message.content
    assert whole.eval_count <= 16
    short = client.chat(model=MODEL_NAME, messages=MESSAGES, options={"temperature": 0, "num_predict": 3})
    assert short.eval_count <= 3 and text.startswith(short.message.content)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if len(stop.strip()) == 2:
        stopped = client.chat(model=MODEL_NAME, messages=MESSAGES,
                              options={"temperature": 0, "num_predict": 16, "stop": [stop]})
        assert stopped.message.content == text[:text.index(stop)] and stopped.done_reason == "stop"


def test_runner_options_are_accepted_and_unhonoured_ones_refused_by_name(client):
    runner = {"num_thread": 2, "num_gpu": 99, "use_mmap": True, "num_batch": 512, "num_keep": 4, "numa": False,
              "main_gpu": 0, "low_vram": False, "use_mlock": False, "penalize_newline": True, "num_ctx": 2048,
              "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "typical_p": 1.0, "repeat_last_n": -1,
              "seed": -1}
    assert client.chat(model=MODEL_NAME, messages=MESSAGES, options={**runner, "num_predict": 2}).done
    for option, value in (("typical_p", 0.5), ("tfs_z", 0.9), ("mirostat", 2), ("repeat_last_n", 64),
                          ("num_ctx", 4097), ("num_predict", -3), ("temperature", -1), ("top_k", "x"),
                          ("no_such_option", 1)):
        with pytest.raises(ollama.ResponseError) as refused:
            client.chat(model=MODEL_NAME, messages=MESSAGES, options={option: value})
        assert refused.value.status_code == 400 and f"options.{option}" in refused.value.error, option


def test_format_constrains_the_output(client):
    got = client.chat(model=MODEL_NAME, messages=MESSAGES, format=SCHEMA, options={"temperature": 0.8, "seed": 1,
                                                                                   "num_predict": 40})
    jsonschema.validate(json.loads(got.message.content), SCHEMA)
    generated = client.generate(model=MODEL_NAME, prompt="Hi", format=SCHEMA, options={"num_predict": 40})
    jsonschema.validate(json.loads(generated.response), SCHEMA)


def test_tools_and_a_call_round_trip_are_rendered_as_chat_renders_them(client, openai):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "22 C", "tool_name": "get_weather"}]
    got = client.chat(model=MODEL_NAME, messages=history, tools=[WEATHER], options=GREEDY)
    as_openai = [history[0],
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "call_1_0", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                 {"role": "tool", "content": "22 C", "tool_call_id": "call_1_0"}]
    want = openai_chat(openai, as_openai, tools=[WEATHER])
    assert got.message.content == (want.choices[0].message.content or "")
    assert got.prompt_eval_count == want.usage.prompt_tokens


def test_logprobs_are_the_chat_endpoints_entries_whole_and_streamed(client, openai):
    whole = client.chat(model=MODEL_NAME, messages=MESSAGES, options=GREEDY, logprobs=True, top_logprobs=2)
    want = openai_chat(openai, MESSAGES, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in whole.logprobs] == [(e.token, e.logprob) for e in want]
    assert [[t.token for t in e.top_logprobs] for e in whole.logprobs] == [[t.token for t in e.top_logprobs]
                                                                          for e in want]
    assert len(whole.logprobs) == whole.eval_count
    parts = list(client.chat(model=MODEL_NAME, messages=MESSAGES, options=GREEDY, logprobs=True, top_logprobs=2,
                             stream=True))
    assert [e for p in parts for e in p.logprobs or ()] == list(whole.logprobs)
    raw = client.generate(model=MODEL_NAME, prompt="The quick", raw=True, options=GREEDY, logprobs=True)
    completion = openai.completions.create(model=MODEL_NAME, prompt="The quick", max_tokens=10, temperature=0,
                                           logprobs=0)
    assert [e.logprob for e in raw.logprobs] == completion.choices[0].logprobs.token_logprobs
    assert client.chat(model=MODEL_NAME, messages=MESSAGES, options=GREEDY).logprobs is None


def test_load_and_unload_requests_are_answered_at_once(client):
    loaded = client.generate(model=MODEL_NAME)
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert client.generate(model=MODEL_NAME, keep_alive=0).done_reason == "unload"
    assert client.generate(model=MODEL_NAME, keep_alive="0s").done_reason == "unload"
    chat = client.chat(model=MODEL_NAME, messages=[])
    assert chat.done_reason == "load" and chat.message.role == "assistant" and chat.message.content == ""
    assert client.chat(model=MODEL_NAME, messages=[], keep_alive=0).done_reason == "unload"
    assert client.generate(model=MODEL_NAME, prompt="Hi", keep_alive="10m", options={"num_predict": 1}).done
    with pytest.raises(ollama.ResponseError) as missing:
        client.generate(model="elsewhere")
    assert missing.value.status_code == 404


@pytest.mark.parametrize("name", ["tiny:7b", "other", "other:latest", "tiny:", "TINY"])
def test_a_name_that_is_not_served_is_ollamas_404(client, name):
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model=name, messages=MESSAGES)
    assert refused.value.status_code == 404 and refused.value.error == f"model '{name}' not found"


@pytest.mark.parametrize("fields, named", [
    ({"suffix": "end"}, "suffix"), ({"template": "{{ .Prompt }}"}, "template"), ({"context": [1, 2]}, "context"),
    ({"images": ["aGk="]}, "images"), ({"think": True}, "think"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"raw": True, "system": "x"}, "system"), ({"think": "high"}, "think"),
])
def test_what_generate_cannot_honour_is_a_400_naming_it(client, fields, named):
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model=MODEL_NAME, prompt="Hi", options={"num_predict": 1}, **fields)
    assert refused.value.status_code == 400 and refused.value.error.startswith(named), refused.value.error


def test_an_image_in_a_message_is_a_400(client):
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model=MODEL_NAME, messages=[{"role": "user", "content": "What is it?", "images": ["aGk="]}])
    assert refused.value.status_code == 400 and refused.value.error.startswith("messages[0].images")
