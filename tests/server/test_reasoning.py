"""`--reasoning-parser`: a thinking model's thinking apart from its answer, whole and streamed.

Pins: each parser splits the texts it meets as documented (`deepseek_r1` begins inside the thinking,
`qwen3` thinks only when the answer opens with `<think>`); a stream, however it is chunked, splits a text
exactly as the whole answer is split; the chat shapes carry `reasoning_content` (message and deltas) and
parse tool calls from the answer after the thinking; structured output's grammar lets the thinking
through first; over HTTP the parser is wired to both shapes.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import GREEDY, MODEL_NAME, openai_client, served, tiny_batcher

from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.server.app import create_app
from ferrox_batch.server.openai.chat_format import ChatFormat
from ferrox_batch.server.reasoning import ReasoningParser, ReasoningSplit
from ferrox_batch.server.tools.hermes import HermesToolCalls
from ferrox_batch.structured import StructuredOutput
from ferrox_batch.usage import Usage

DEEPSEEK, QWEN3 = ReasoningParser("deepseek_r1"), ReasoningParser("qwen3")


@pytest.mark.parametrize("text, deepseek, qwen3", [
    ("<think>a b</think>\n\nAnswer", ("a b", "\n\nAnswer"), ("a b", "\n\nAnswer")),
    ("a b</think>Answer", ("a b", "Answer"), (None, "a b</think>Answer")),
    ("Answer only", ("Answer only", None), (None, "Answer only")),
    ("<think>never ends", ("never ends", None), ("never ends", None)),
    ("  <think>x</think>y", ("x", "y"), ("x", "y")),
    ("<think></think>z", ("", "z"), ("", "z")),
    ("", (None, None), (None, None)),
])
def test_each_parser_splits_as_documented(text, deepseek, qwen3):
    assert DEEPSEEK.split(text) == deepseek
    assert QWEN3.split(text) == qwen3


FRAGMENTS = st.sampled_from(["<think>", "</think>", "<thi", "nk>", "</", "think>", "<", ">", " ", "\n", "a", "é"])


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(FRAGMENTS, max_size=12), cuts=st.lists(st.integers(0, 80), max_size=6),
       implicit=st.booleans())
def test_a_stream_splits_as_the_whole_answer_does(pieces, cuts, implicit):
    text = "".join(pieces)
    parser = DEEPSEEK if implicit else QWEN3
    split = ReasoningSplit(parser.implicit)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    thinking, content = "", ""
    for a, b in zip(bounds, bounds[1:]):
        t, c = split.feed(text[a:b])
        thinking, content = thinking + t, content + c
    t, c = split.finish()
    whole = parser.split(text)
    assert (thinking + t if split.thought and text else None, (content + c) or None) == whole


def result(text: str) -> GenerationResult:
    return GenerationResult(FinishReason.STOP, (), text, Usage.new(1, 1))


def test_chat_shapes_carry_the_thinking_and_the_calls_after_it():
    text = '<think>hmm</think>Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    fmt = ChatFormat("m", "r")
    fmt.reasoning, fmt.tool_parser = QWEN3, HermesToolCalls()
    message = fmt._full_choice(result(text))["message"]
    assert message["reasoning_content"] == "hmm" and message["content"] == "Hi"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]
    stream = ChatFormat("m", "r")
    stream.reasoning, stream.tool_parser = QWEN3, HermesToolCalls()
    chunks = [c for i in range(0, len(text), 4) for c in stream.stream_chunks(0, text[i:i + 4])]
    closing, reason = stream.closing_chunks(0, FinishReason.STOP)
    deltas = [c["choices"][0]["delta"] for c in chunks + closing]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hmm"
    assert "".join(d.get("content", "") for d in deltas).strip() == "Hi"
    assert [t["function"]["name"] for d in deltas for t in d.get("tool_calls", []) if "id" in t] == ["f"]
    assert reason == "tool_calls"


def test_a_grammar_lets_the_thinking_through_first(tiny_batch_model):
    from ferrox_batch.runtime.sampling.grammar import Grammars

    tokenizer = tiny_batch_model.tokenizer
    grammars = Grammars(tokenizer.inner.to_str(), tiny_batch_model.config.vocab_size, sorted(tokenizer.stop_tokens.ids))
    answer = StructuredOutput.regex("(yes|no)")

    def accepts(spec: StructuredOutput, text: str) -> bool:
        matcher = grammars.matcher(grammars.compile(spec))
        ok = all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return ok and not matcher.is_error() and matcher.is_accepting()

    implicit = dataclasses.replace(answer, reasoning="implicit")
    tagged = dataclasses.replace(answer, reasoning="tagged")
    assert accepts(implicit, "<think>a {b}</think>yes") and accepts(implicit, "a b</think>no")
    assert not accepts(implicit, "yes") and not accepts(implicit, "<think>x</think>maybe")
    assert accepts(tagged, "<think>x</think>yes") and accepts(tagged, "no") and not accepts(tagged, "x</think>no")


def test_the_parser_is_wired_to_both_shapes(tiny_batch_model):
    messages = [{"role": "user", "content": "Think."}]
    plain_batcher = tiny_batcher(tiny_batch_model)
    with served(plain_batcher) as (url, _app), openai_client(url) as client:
        plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, **GREEDY)
    batcher = tiny_batcher(tiny_batch_model)
    with served(batcher, reasoning_parser="deepseek_r1") as (url, _app), openai_client(url) as client:
        whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, **GREEDY)
        stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, stream=True,
                                                **GREEDY)
        deltas = [c.choices[0].delta for c in stream if c.choices]
    text = plain.choices[0].message.content
    assert "</think>" not in text  # a random model never closes its thinking: all of it is thinking
    assert whole.choices[0].message.model_extra["reasoning_content"] == text
    assert whole.choices[0].message.content is None
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == text
    assert "".join(d.content or "" for d in deltas) == ""
    refused = tiny_batcher(tiny_batch_model)
    try:
        with pytest.raises(ValueError, match="reasoning parser"):
            create_app(refused, model_name="m", reasoning_parser="nope")
    finally:
        assert refused.close(10)
