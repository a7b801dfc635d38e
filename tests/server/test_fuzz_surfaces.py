"""Fuzzing the Anthropic and Ollama surfaces as the OpenAI routes are fuzzed (`test_fuzz_api`): plausible
requests of each API with a few fields, top-level or nested, turned nasty, and now and then anything at
all, sent to a real server. After every example: no 5xx, every 4xx in the API's own error shape
(`fuzz_helpers.check`), the worker alive, and once idle every KV block free."""

from __future__ import annotations

import pytest
from fuzz_bodies import anything, bad_schema, bodies, content_types, field, post, prompt_text, schema, texts, tool
from fuzz_helpers import FUZZ_SETTINGS, fuzzed_server
from hypothesis import given
from hypothesis import strategies as st

text_block = st.fixed_dictionaries({"type": st.just("text"), "text": prompt_text})
tool_use = st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.just("toolu_1"), "name": st.just("f"),
                                  "input": st.just({"a": 1})})
tool_result = st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.just("toolu_1"),
                                     "content": st.one_of(prompt_text, st.lists(text_block, min_size=1, max_size=2)),
                                     "is_error": st.booleans()})
anthropic_messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                    "content": st.one_of(prompt_text, st.lists(text_block, min_size=1, max_size=2))}),
             min_size=1, max_size=3),
    st.tuples(prompt_text, tool_use, tool_result).map(lambda t: [
        {"role": "user", "content": t[0]}, {"role": "assistant", "content": [t[1]]}, {"role": "user", "content": [t[2]]}]))
bad_anthropic_messages = st.one_of(
    st.just([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AA=="}}]}]),
    st.just([{"role": "user", "content": [{"type": "document", "source": {}}]}]),
    st.just([{"role": "system", "content": "hi"}]),
    st.lists(st.fixed_dictionaries({"role": st.one_of(texts, anything), "content": st.one_of(texts, anything)}),
             min_size=1, max_size=2),
    st.builds(lambda ok, bad: ok + [{"role": "user", "content": [bad]}], st.lists(st.just(
        {"role": "user", "content": "hi"}), max_size=1), st.one_of(
        st.fixed_dictionaries({"type": st.one_of(st.just("tool_result"), texts), "tool_use_id": st.one_of(texts, anything),
                               "content": st.one_of(texts, anything)}),
        st.fixed_dictionaries({"type": st.just("tool_use"), "id": texts, "name": texts, "input": anything}))))
anthropic_tool = st.fixed_dictionaries({"name": st.sampled_from(["f", "get_weather"]), "input_schema": schema,
                                        "description": st.text(max_size=20)})
MESSAGES = {
    "model": field(st.just("tiny"), "other", "", None, 5),
    "max_tokens": field(st.integers(1, 6), 0, -1, 2**63, 2**64, 0.5, "3", None),
    "messages": field(anthropic_messages, [], {}, "hi", None),
    "system": field(st.one_of(prompt_text, st.lists(text_block, min_size=1, max_size=2)), 5, [{"type": "image"}],
                    [{"type": "text"}], [{"type": "text", "text": 5}]),
    "stop_sequences": field(st.lists(st.text(min_size=1, max_size=5), max_size=3), "x", [""], [1], ["ab"] * 100),
    "temperature": field(st.floats(0, 1), -1.0, 1.5, 1e39, "hot"),
    "top_p": field(st.floats(0.01, 1.0), 0.0, 1.0000001, "x"),
    "top_k": field(st.integers(1, 50), 0, -1, 2**63),
    "stream": field(st.booleans(), 1, "yes"),
    "metadata": field(st.just({"user_id": "u-1"}), {"user_id": 5}, [], {"other": 1}),
    "tools": field(st.lists(anthropic_tool, max_size=2), [{"name": 1}], "t", [{"name": "f", "input_schema": 5}],
                   [{"type": "web_search_20250305", "name": "web_search"}],
                   st.builds(lambda s: [{"name": "f", "input_schema": s}], bad_schema)),
    "tool_choice": field(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}]),
                         {"type": "tool"}, {"type": "tool", "name": "missing"}, "auto", {"type": "x"},
                         {"type": "auto", "disable_parallel_tool_use": "no"}),
    "thinking": field(st.just({"type": "disabled"}), {"type": "enabled", "budget_tokens": 1},
                      {"type": "enabled"}, "on", {"type": "x"}),
    "output_format": field(st.builds(lambda s: {"type": "json_schema", "schema": s}, schema),
                           {"type": "json_schema"}, {"type": "xml"}, 5,
                           st.builds(lambda s: {"type": "json_schema", "schema": s}, bad_schema)),
    "service_tier": field(st.just("auto"), "priority", 5),
    "container": field(st.none(), "c"),
    "an_unknown_field": field(anything),
}
ollama_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                        "content": prompt_text})
options = st.fixed_dictionaries({"num_predict": st.integers(1, 6)}, optional={
    "temperature": st.floats(0, 2), "top_k": st.integers(1, 50), "top_p": st.floats(0.01, 1.0),
    "min_p": st.floats(0, 1), "repeat_penalty": st.floats(0.5, 2), "seed": st.integers(0, 2**31),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2), "num_ctx": st.integers(64, 256),
    "num_thread": st.integers(1, 4)})
BAD_OPTIONS = ({"num_predict": -3}, {"num_predict": 2**64}, {"temperature": "hot"}, {"mirostat": 2},
               {"num_ctx": 2**64}, {"an_unknown_option": 1}, [], "o", {"stop": "\ud800"}, {"typical_p": 0.5},
               {"num_predict": 3, "repeat_last_n": 64})
GENERATING = {
    "model": field(st.sampled_from(["tiny", "tiny:latest"]), "other", "tiny:v2", "", 5, None),
    "stream": field(st.booleans(), 1, "yes"),
    "options": field(options, *BAD_OPTIONS),
    "format": field(st.one_of(st.just("json"), schema), "xml", 5, {"type": "nonsense"}),
    "think": field(st.just(False), True, "high", 5),
    "keep_alive": field(st.sampled_from(["5m", 0, "0", 300]), [], {}, "forever"),
    "an_unknown_field": field(anything),
}
OLLAMA_CHAT = {
    **GENERATING,
    "messages": field(st.lists(ollama_message, min_size=1, max_size=3), {}, "hi", [{"role": "robot"}],
                      [{"role": "user", "content": "x", "images": ["AAAA"]}], [{"role": "user", "content": 5}]),
    "tools": field(st.lists(tool, max_size=1), "t", [{"type": "function"}]),
}
OLLAMA_GENERATE = {
    **GENERATING,
    "prompt": field(prompt_text, 5, [], "\ud800"),
    "system": field(prompt_text, 5),
    "raw": field(st.booleans(), "yes"),
    "suffix": field(st.just(""), "tail"),
    "template": field(st.just(""), "{{ .Prompt }}"),
    "context": field(st.just([]), [1, 2, 3]),
    "images": field(st.just([]), ["AAAA"]),
}


@pytest.fixture(scope="module")
def fuzzed(tiny_batch_model):
    with fuzzed_server(tiny_batch_model) as http:
        yield http


@FUZZ_SETTINGS
@given(body=bodies(MESSAGES, "model", "max_tokens", "messages"), content_type=content_types,
       route=st.sampled_from(["/v1/messages", "/v1/messages?beta=true", "/v1/messages/count_tokens"]))
def test_messages_never_answer_5xx_and_hold_nothing(fuzzed, body, content_type, route):
    post(fuzzed, route, body, content_type)


@FUZZ_SETTINGS
@given(body=bodies(OLLAMA_CHAT, "model", "messages", "options"), content_type=content_types)
def test_ollama_chat_never_answers_5xx_and_holds_nothing(fuzzed, body, content_type):
    post(fuzzed, "/api/chat", body, content_type)


@FUZZ_SETTINGS
@given(body=bodies(OLLAMA_GENERATE, "model", "prompt", "options"), content_type=content_types,
       route=st.sampled_from(["/api/generate", "/api/embed", "/api/show"]))
def test_ollama_generate_embed_and_show_never_answer_5xx(fuzzed, body, content_type, route):
    post(fuzzed, route, body, content_type)
