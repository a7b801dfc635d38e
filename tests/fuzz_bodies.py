"""The request bodies the fuzz tests send: plausible requests of each API with a few of their fields, top-level
or nested, turned nasty (`bodies`), and the value strategies they are built from."""

from __future__ import annotations

import json
from typing import Any

import httpx
from fuzz_helpers import VOCAB, check
from hypothesis import strategies as st

# JSON that `json.dumps` cannot write: placeholders swapped for raw tokens after dumping.
RAW = {"\x00RAW-NAN\x00": "NaN", "\x00RAW-INF\x00": "Infinity", "\x00RAW-NEGINF\x00": "-Infinity",
       "\x00RAW-BIG\x00": "1e999", "\x00RAW-NEGBIG\x00": "-1e999", "\x00RAW-TINY\x00": "1e-999"}

LIMIT_INTS = [0, 1, -1, 2, 255, 256, 383, 384, 2**15, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
              2**64 - 1, 2**64, 2**100, -2**63, -2**64, 10**30]
EDGE_FLOATS = [0.0, -0.0, 1e-45, 1e-38, 1.1754943508222875e-38, 5e-324, 3.4028234663852886e38, 3.5e38, 1e308,
               -1e308, 1e-5, 0.5, 1.0, 2.0, 100.0, 100.0001, -100.0001]
NASTY_TEXT = ["", "\ud800", "a\udfffb", "\x00", "nul\x00in", "\u2028\u2029", "<tool_call>" + " " * 2000,
              "<tool_call>{\"name\": \"f\"}</tool_call>", "x" * 5000, "\U0001f680", "{{ raise }}", "%0a", "\r\n"]

texts = st.one_of(st.text(max_size=30), st.sampled_from(NASTY_TEXT))
ints = st.one_of(st.integers(-3, 40), st.sampled_from(LIMIT_INTS), st.integers(-2**70, 2**70))
floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(EDGE_FLOATS))
raw_numbers = st.sampled_from(list(RAW))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, raw_numbers, texts)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(texts, inner, max_size=4)),
                      max_leaves=12)


@st.composite
def nested(draw: st.DrawFn) -> Any:
    """A value nested far deeper than any request does."""
    depth = draw(st.integers(20, 400))
    value: Any = draw(scalars)
    for level in range(depth):
        value = [value] if level % 2 else {"a": value}
    return value


anything = st.one_of(values, nested(), st.lists(ints, min_size=1000, max_size=3000))


def field(valid: st.SearchStrategy, *edges: Any) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """A field's plausible values, and its nasty ones: mostly `edges` of its own, else anything at all."""
    return valid, (st.one_of(st.sampled_from(edges), st.sampled_from(edges), anything) if edges else anything)


#: JSON text nested past the interpreter's recursion limit, for the fields that hold JSON in a string.
DEEP_JSON = "[" * 5000 + "]" * 5000
BAD_IDS = [VOCAB, 2**63 - 1, 2**63, 2**64, 2**64 + 5, -1, -2**63]
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=48)
# Long enough to fill a prefix-cache block, with one id outside the vocabulary somewhere.
bad_token_ids = st.builds(lambda ids, bad, at: ids[:at] + [bad] + ids[at:],
                          st.lists(st.integers(0, VOCAB - 1), min_size=17, max_size=40),
                          st.sampled_from(BAD_IDS), st.integers(0, 20))
prompt_text = st.one_of(st.text(min_size=1, max_size=80), st.text(min_size=40, max_size=200))
logit_bias = st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3)
schema = st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 3},
                          {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}])
bad_schema = st.one_of(
    st.dictionaries(st.sampled_from(["type", "properties", "$ref", "enum", "pattern", "items"]), values, max_size=3),
    st.just({"type": "string", "pattern": "(a+)+$" * 50}),
    st.just({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}))
response_format = st.one_of(
    st.just({"type": "text"}), st.just({"type": "json_object"}),
    st.fixed_dictionaries({"type": st.just("json_schema"),
                           "json_schema": st.fixed_dictionaries({"name": st.just("out"), "schema": schema})}))
bad_response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["lark", "xml", "", "\ud800"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {"name": texts, "schema": st.one_of(bad_schema, anything)})}))
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({
    "name": st.sampled_from(["get_weather", "f"]), "parameters": schema, "description": st.text(max_size=20)})})
bad_tool = st.fixed_dictionaries({"type": st.one_of(st.just("function"), texts), "function": st.one_of(
    anything, st.fixed_dictionaries({"name": st.one_of(texts, st.just("a" * 65)),
                                     "parameters": st.one_of(bad_schema, anything),
                                     "description": st.one_of(texts, anything)}))})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": st.one_of(prompt_text, st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": prompt_text}), min_size=1, max_size=2))})
bad_message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["tool", "robot", "", "\ud800"]), anything),
     "content": st.one_of(texts, anything, st.lists(st.fixed_dictionaries(
         {"type": st.one_of(st.just("text"), texts), "text": st.one_of(texts, anything)}), max_size=3))},
    optional={"tool_calls": st.one_of(anything, st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries(
        {"name": texts, "arguments": st.one_of(texts, anything, st.just(DEEP_JSON))})}), max_size=2)),
              "tool_call_id": st.one_of(texts, anything)})
messages = st.lists(message, min_size=1, max_size=3)
bad_messages = st.builds(lambda good, bad, at: good[:at] + [bad] + good[at:], st.lists(message, max_size=2),
                         bad_message, st.integers(0, 2))

COMMON = {
    "model": field(st.just("tiny"), "other", "", None),
    "max_tokens": field(st.integers(0, 6), -1, 2**63, 2**64, 10**9, 0.5, "3"),
    "max_completion_tokens": field(st.integers(0, 6), -1, 2**64),
    "temperature": field(st.floats(0, 2), 1e-45, 3.5e38, 1e39, -0.0, 1e-6, "\x00RAW-BIG\x00"),
    "top_p": field(st.floats(0.01, 1.0), 0.0, 1e-40, 1.0000001),
    "top_k": field(st.integers(-1, 50), 2**63, -2),
    "min_p": field(st.floats(0, 1), 5e-324, 1e-40),
    "repetition_penalty": field(st.floats(0.5, 2), 1e-45, 1e-38, 3.4e38, 1e39, 0.0),
    "presence_penalty": field(st.floats(-2, 2), 2.0000001, 1e-45),
    "frequency_penalty": field(st.floats(-2, 2), -2.0000001, 5e-324),
    "logit_bias": field(logit_bias, {str(VOCAB): 1}, {str(2**64): 1}, {"-1": 1}, {"1e5": 1}, {"x": 1}, {"5": 101},
                        {"5": 1e-45}, {"5": "\x00RAW-NAN\x00"}, {"9" * 5000: 1}),
    "seed": field(st.integers(0, 2**32), -1, 2**64, 2**64 - 1),
    "stop": field(st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=4)),
                  "\ud800", ["ok", "\udc00"], ["ab"] * 100, "x" * 300, [""], ["\x00"]),
    "stop_token_ids": field(st.lists(st.integers(0, VOCAB - 1), max_size=4), [2**64], [-1], list(range(300))),
    "ignore_eos": field(st.booleans(), 1, "true"),
    "stream": field(st.booleans(), 1, "yes"),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()}), {"include_usage": 1}, []),
    "n": field(st.integers(1, 3), 0, 17, 2**64),
    "cache_salt": field(st.text(min_size=1, max_size=8), "\ud800", "\udfff\ud800", "", "\x00"),
    "priority": field(st.just(0), 1, -1, 2**31, 2**64),
    "max_queue_wait_ms": field(st.integers(30_000, 60_000), 0, -1, 2**64),  # a short wait is a fair 503
    "min_tokens": field(st.integers(0, 3), -1, 2**64, 10**6),
    "include_stop_str_in_output": field(st.booleans(), 1),
    "skip_special_tokens": field(st.booleans(), "no"),
    "spaces_between_special_tokens": field(st.booleans(), 0),
    "bad_words": field(st.lists(st.text(min_size=1, max_size=6), max_size=3), "w", [""], ["\ud800"], ["w"] * 65,
                       ["x" * 500]),
    "allowed_token_ids": field(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), [], [VOCAB], [-1],
                               [2**64], [1.5]),
    "truncate_prompt_tokens": field(st.one_of(st.integers(1, 8), st.just(-1)), 0, -2, 2**64),
    "prompt_logprobs": field(st.integers(0, 3), 21, -1, True),
    "return_token_ids": field(st.booleans(), "true"),
    "an_unknown_field": field(anything),
}
COMPLETION = {**COMMON,
              "prompt": field(st.one_of(prompt_text, token_ids, st.lists(prompt_text, min_size=1, max_size=3),
                                        st.lists(token_ids, min_size=1, max_size=3)),
                              [], "", [[]], [[1, 2], []], ["a", 1], [[1], "b"], [[VOCAB]], ["x"] * 65, "\ud800",
                              "hi \udfff there", ["\ud800"]),
              "echo": field(st.booleans()), "best_of": field(st.integers(1, 3), 0, 17),
              "logprobs": field(st.integers(0, 5), 21, -1, True), "suffix": field(st.just(""), "tail")}
CHAT = {**COMMON, "messages": field(messages, [], {}, "hi", [{"role": "user", "content": "\ud800"}]),
        "tools": field(st.lists(tool, max_size=2), [], {}, [{"type": "function"}]),
        "tool_choice": field(st.sampled_from(["none", "auto", "required"]), {"type": "function"},
                             {"type": "function", "function": {"name": "missing"}}),
        "response_format": field(response_format),
        "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(0, 5), 21, -1),
        "parallel_tool_calls": field(st.booleans(), "no"),
        "add_generation_prompt": field(st.booleans(), 1), "continue_final_message": field(st.booleans(), "x"),
        "chat_template_kwargs": field(st.dictionaries(st.sampled_from(["enable_thinking", "x"]), st.booleans(),
                                                      max_size=2), {"messages": []}, {"a b": 1}, "kw",
                                      {"big": "x" * 20_000}, {"namespace": 1}, {"range": "x"}, {"loop": 1}),
        "structured_outputs": field(st.sampled_from([{"regex": "[ab]{1,3}"}, {"choice": ["yes", "no"]},
                                                     {"grammar": 'start: "a" | "b"'}, {"json_object": True},
                                                     {"grammar": 'root ::= "x" [0-9]'}]),
                                    {"regex": "("}, {"grammar": "root ::= (("}, {"choice": []}, {"json": "{"},
                                    {"structural_tag": 1}, {"regex": "a", "choice": ["a"]}, "regex"),
        "guided_regex": field(st.just("[a-c]{2}"), "[z-a]", 5),
        "guided_choice": field(st.just(["a", "b"]), [], [1]),
        "guided_grammar": field(st.just('start: "ok"'), "start: undefined"),
        "guided_decoding_backend": field(st.just("auto"), "outlines")}
EMBEDDINGS = {"model": field(st.just("tiny"), "other"),
              "input": field(st.one_of(prompt_text, token_ids, st.lists(prompt_text, min_size=1, max_size=3),
                                       st.lists(token_ids, min_size=1, max_size=3)),
                             [], "", [[]], [[VOCAB]], ["x"] * 65, "\ud800", [1.5]),
              "encoding_format": field(st.sampled_from(["float", "base64"]), "int8", 1),
              "dimensions": field(st.integers(1, 64), 0, -1, 2**64, 10**6),
              "normalize": field(st.booleans(), "yes"), "pooling": field(st.sampled_from(["last", "mean"]), "cls"),
              "truncate_prompt_tokens": field(st.integers(1, 8), 0, -5), "user": field(texts, 5)}
response_input = st.one_of(prompt_text, st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                           "content": st.one_of(prompt_text, st.lists(st.fixed_dictionaries(
                               {"type": st.just("input_text"), "text": prompt_text}), min_size=1, max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("call_1"),
                           "name": st.just("f"), "arguments": st.sampled_from(["{}", DEEP_JSON])}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("call_1"),
                           "output": prompt_text})), min_size=1, max_size=3))
RESPONSES = {"model": field(st.just("tiny"), "other"), "input": field(response_input, [], "", [{"type": "x"}],
                                                                    [{"role": "user", "content": [{"type": "input_image"}]}]),
             "instructions": field(prompt_text, 5), "max_output_tokens": field(st.integers(1, 6), -1, 2**64),
             "temperature": field(st.floats(0, 2), -1.0), "stream": field(st.booleans(), "yes"),
             "tools": field(st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": st.just("f"),
                                                            "parameters": st.just({"type": "object"})}), max_size=1),
                            [{"type": "web_search"}], "t"),
             "tool_choice": field(st.sampled_from(["auto", "none"]), {"type": "function", "name": "nope"}),
             "text": field(st.just({"format": {"type": "json_object"}}), {"format": {"type": "xml"}}, 3),
             "previous_response_id": field(st.none(), "resp_1"), "store": field(st.just(False), True),
             "metadata": field(st.just({"k": "v"}), {"k": 1}), "an_unknown_field": field(anything)}
TOKENIZE = {"prompt": field(prompt_text, "\ud800", "a\udfffb", ""), "messages": field(messages),
            "add_special_tokens": field(st.booleans()),
            "add_generation_prompt": field(st.booleans()), "return_token_strs": field(st.booleans()),
            "tools": field(st.lists(tool, max_size=2)), "continue_final_message": field(st.booleans()),
            "chat_template_kwargs": field(st.just({"enable_thinking": False}), {"tools": 1})}
DETOKENIZE = {"tokens": field(token_ids, [2**64], [-1], [VOCAB], [[1]])}
#: Nasty values deep inside a field that is otherwise valid.
NESTED_BAD = {"prompt": bad_token_ids, "messages": bad_messages, "tools": st.lists(bad_tool, min_size=1, max_size=2),
              "response_format": bad_response_format, "tokens": bad_token_ids}


@st.composite
def request_body(draw: st.DrawFn, fields: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]],
                 required: tuple[str, ...]) -> dict[str, Any]:
    """A plausible request (its required fields and some optional ones, each valid), with zero to two of its
    fields, top-level or nested, turned nasty: a bad value deep inside an otherwise valid request is
    reached, not only the first field a parser reads."""
    names = sorted(fields)
    body = {name: draw(fields[name][0]) for name in names if name in required or draw(st.booleans())}
    # The fields that nest (prompts, messages, tools, schemas) are turned nasty inside half the time: they
    # hide the most.
    nesting = [name for name in names if name in NESTED_BAD]
    if nesting and draw(st.booleans()):
        name = draw(st.sampled_from(nesting))
        body[name] = draw(NESTED_BAD[name])
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(names))
        body[name] = draw(fields[name][1])
    return body


def bodies(fields: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]], *required: str) -> st.SearchStrategy:
    """Request bodies: mostly plausible requests with a few nasty fields; sometimes anything, JSON or not."""
    plausible = request_body(fields, required).map(encode)
    return st.one_of(plausible, plausible, plausible, plausible, anything.map(encode), st.binary(max_size=64),
                     st.sampled_from([b"", b"{", b"[]", b"null", b'{"a": 1}' * 2]))


def encode(value: Any) -> bytes:
    text = json.dumps(value)  # ensure_ascii: a lone surrogate is written as its \u escape, as clients do
    for marker, raw in RAW.items():
        text = text.replace(json.dumps(marker), raw)
    return text.encode()


content_types = st.one_of(st.just("application/json"), st.just("application/json"), st.just("application/json"),
                          st.sampled_from(["application/json; charset=utf-8", "text/plain", "",
                                           "application/x-www-form-urlencoded"]))


def post(http: httpx.Client, route: str, body: bytes, content_type: str) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    with http.stream("POST", route, content=body, headers=headers) as reply:
        reply.read()  # a stream is read to its end, as a client would
    check(http, reply)
