"""The Ollama API's pure parts: options, names, request translation, the error shape and the durations.

Pins: runner-only options change nothing, and only Ollama's defaults are said for a request with none;
`num_predict`'s -1 and -2 are the context, other negatives a 400 naming it; a name matches with or without
`:latest` and nothing else does; a chat is its messages with their calls' arguments as objects, a
templated generate a system and a user message, a raw one the completion of its prompt; load requests are
answered at once, unloads when `keep_alive` is a zero duration; the error shape keeps the status, writes
the message alone and names the Ollama field a translated refusal came from; durations are non-negative
integers whose total covers the parts.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferrox_batch.errors import InvalidRequest, QueueFull
from ferrox_batch.server.http.errors import error_body
from ferrox_batch.server.ollama.answers import durations
from ferrox_batch.server.ollama.errors import OLLAMA_ERRORS, OLLAMA_FIELDS, OllamaModelNotFound
from ferrox_batch.server.ollama.names import served_name, tagged
from ferrox_batch.server.ollama.options import DEFAULTS, RUNNER_ONLY, options_fields
from ferrox_batch.server.surface import AnsweredAtOnce
from ferrox_batch.server.ollama.translation import OLLAMA_CHAT, OLLAMA_EMBED, OLLAMA_GENERATE, Served, translate
from ferrox_batch.server.unhonoured import CHAT, COMPLETIONS
from ferrox_batch.usage import Usage

SERVED = Served(("tiny", "alias"), 512, 1024)
ANY = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5))


@given(st.dictionaries(st.sampled_from(sorted(RUNNER_ONLY)), ANY))
def test_runner_options_change_nothing(options):
    assert options_fields(options, context_length=512) == DEFAULTS


@given(st.integers(-10, 10**6))
def test_num_predict_is_max_tokens_and_its_negatives_the_context(n):
    if n in (-1, -2):
        assert options_fields({"num_predict": n}, context_length=512)["max_tokens"] == 512
    elif n < 0:
        with pytest.raises(InvalidRequest) as refused:
            options_fields({"num_predict": n}, context_length=512)
        assert refused.value.param == "options.num_predict"
    else:
        assert options_fields({"num_predict": n}, context_length=512)["max_tokens"] == n


@given(st.text(min_size=1, max_size=12).filter(lambda s: s not in {"num_predict", "num_ctx", "seed", "stop",
                                                                    "repeat_last_n", "temperature", "top_k",
                                                                    "top_p", "min_p", "repeat_penalty",
                                                                    "presence_penalty", "frequency_penalty",
                                                                    "typical_p", "tfs_z", "mirostat",
                                                                    "mirostat_tau", "mirostat_eta"}
                                                  and s not in RUNNER_ONLY))
def test_an_unknown_option_is_refused_by_name(name):
    with pytest.raises(InvalidRequest) as refused:
        options_fields({name: 1}, context_length=512)
    assert refused.value.param == f"options.{name}"


def test_repeat_last_n_zero_turns_the_penalties_off():
    fields = options_fields({"repeat_penalty": 1.5, "presence_penalty": 1, "repeat_last_n": 0}, context_length=None)
    assert "repetition_penalty" not in fields and "presence_penalty" not in fields


NAME = st.text(st.characters(codec="ascii", exclude_characters=":"), min_size=1, max_size=10)


@given(NAME, st.text(st.characters(codec="ascii"), max_size=6))
def test_a_name_matches_with_or_without_latest_and_nothing_else_does(name, tag):
    assert served_name(name, [name]) == name and served_name(f"{name}:latest", [name]) == name
    assert served_name(name, [f"{name}:latest"]) == f"{name}:latest"
    asked = f"{name}:{tag}"
    if tag == "latest":
        assert served_name(asked, [name]) == name
    else:
        with pytest.raises(OllamaModelNotFound) as missing:
            served_name(asked, [name])
        assert str(missing.value) == f"model '{asked}' not found"
    assert tagged(tagged(name)) == tagged(name) == f"{name}:latest"


def test_a_chat_is_its_messages_with_the_calls_arguments_as_objects():
    body = {"model": "alias:latest", "stream": False, "options": {"num_predict": 5}, "think": False,
            "messages": [{"role": "user", "content": "Hi", "images": []},
                         {"role": "assistant", "thinking": "hm", "tool_calls": [
                             {"function": {"name": "f", "arguments": {"a": 1}}}]},
                         {"role": "tool", "content": "2", "tool_name": "f"}],
            "tools": [{"type": "function", "function": {"name": "f"}}], "format": "json", "keep_alive": "5m"}
    translated = translate(OLLAMA_CHAT, body, SERVED)
    assert translated.kind == CHAT
    chat = translated.body
    assert chat["model"] == "alias" and chat["stream"] is False and chat["max_tokens"] == 5
    assert chat["messages"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1_0", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "2", "tool_call_id": "call_1_0"}]
    assert chat["response_format"] == {"type": "json_object"} and chat["tools"] == body["tools"]
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert {k: chat[k] for k in DEFAULTS} == DEFAULTS


def test_generate_is_a_system_and_a_user_message_or_with_raw_the_prompt():
    templated = translate(OLLAMA_GENERATE, {"model": "tiny", "system": "S", "prompt": "P"}, SERVED)
    assert templated.kind == CHAT and templated.body["messages"] == [{"role": "system", "content": "S"},
                                                                     {"role": "user", "content": "P"}]
    assert templated.body["stream"] is True and templated.body["max_tokens"] == 1024
    raw = translate(OLLAMA_GENERATE, {"model": "tiny", "prompt": "P", "raw": True, "format": {"type": "object"}},
                    SERVED)
    assert raw.kind == COMPLETIONS and raw.body["prompt"] == "P" and "messages" not in raw.body
    assert raw.body["response_format"]["json_schema"]["schema"] == {"type": "object"}


@pytest.mark.parametrize("keep_alive, reason", [
    (None, "load"), ("5m", "load"), (-1, "load"), (300, "load"), ("1h0m", "load"),
    (0, "unload"), (0.0, "unload"), ("0", "unload"), ("0s", "unload"), ("0m", "unload"), ("0.0h", "unload"),
])
@pytest.mark.parametrize("endpoint, body", [(OLLAMA_GENERATE, {}), (OLLAMA_GENERATE, {"prompt": ""}),
                                            (OLLAMA_CHAT, {}), (OLLAMA_CHAT, {"messages": []})])
def test_a_request_with_nothing_to_generate_is_a_load_or_an_unload(endpoint, body, keep_alive, reason):
    with pytest.raises(AnsweredAtOnce) as answered:
        translate(endpoint, {"model": "tiny", "keep_alive": keep_alive, **body}, SERVED)
    assert answered.value.body["done"] is True and answered.value.body["done_reason"] == reason
    assert answered.value.body["model"] == "tiny"


def test_an_embedding_of_nothing_is_a_load_and_truncate_leaves_the_context_a_position():
    with pytest.raises(AnsweredAtOnce) as answered:
        translate(OLLAMA_EMBED, {"model": "tiny", "input": []}, SERVED)
    assert answered.value.body == {"model": "tiny", "embeddings": []}
    body = translate(OLLAMA_EMBED, {"model": "tiny", "input": ["a"]}, SERVED).body
    assert body["truncate_prompt_tokens"] == 511 and body["normalize"] is True
    assert "truncate_prompt_tokens" not in translate(OLLAMA_EMBED, {"model": "tiny", "input": "a",
                                                                    "truncate": False}, SERVED).body


@given(st.sampled_from(sorted(OLLAMA_FIELDS)), st.text(max_size=8), st.integers(400, 599))
def test_the_error_shape_keeps_the_status_and_names_the_ollama_field(param, reason, status):
    refusal = InvalidRequest(param, 1, reason or "is wrong")
    got_status, body = OLLAMA_ERRORS.translate(status, refusal.to_dict())
    assert got_status == status and list(body) == ["error"]
    assert body["error"] == OLLAMA_FIELDS[param] + str(refusal)[len(param):]


def test_a_refusal_without_a_field_is_its_message_alone():
    assert OLLAMA_ERRORS.translate(503, error_body(QueueFull(3, 3))) == (503, {"error": str(QueueFull(3, 3))})
    assert OLLAMA_ERRORS.translate(500, error_body(RuntimeError("x"))) == (500, {"error": "internal server error "
                                                                                          "(RuntimeError)"})


SECONDS = st.floats(0, 100, allow_nan=False)


@given(st.integers(0, 10**4), st.integers(0, 10**4), SECONDS, SECONDS, SECONDS)
def test_durations_are_integer_nanoseconds_whose_total_covers_the_parts(prompt, output, queue, prefill, decode):
    usage = Usage.new(prompt, output).with_timings(prefill, decode).with_queue_time(queue)
    got = durations(usage, arrival=0.0)
    assert all(isinstance(v, int) and v >= 0 for v in got.values())
    assert got["total_duration"] >= got["load_duration"] + got["prompt_eval_duration"] + got["eval_duration"]
    assert (got["prompt_eval_count"], got["eval_count"]) == (prompt, output)
    assert abs(got["eval_duration"] - decode * 1e9) <= 1 + decode * 1e9 * 2**-52


def test_each_tool_answer_is_paired_with_the_earliest_unanswered_call_of_its_function():
    calls = [{"function": {"name": name, "arguments": {}}} for name in ("f", "g", "f")]
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": calls},
                {"role": "tool", "content": "g's", "tool_name": "g"}, {"role": "tool", "content": "f's"},
                {"role": "tool", "content": "f's again", "tool_name": "f"}, {"role": "tool", "content": "extra"}]
    said = translate(OLLAMA_CHAT, {"model": "tiny", "messages": messages}, SERVED).body["messages"]
    assert [m.get("tool_call_id") for m in said[2:]] == ["call_1_1", "call_1_0", "call_1_2", None]
