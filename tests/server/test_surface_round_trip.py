"""Every surface says the same answer: what the OpenAI chat writer makes of an engine result (content,
reasoning, tool calls and finish reason), read back from the Anthropic and Ollama writers' answers, whole
and streamed in any cutting of the text, is unchanged.

The results are drawn from the parts a reasoning model with tools writes: a thinking span, text, and tool
calls (Hermes tags), in the order a model writes them, each text free of the markers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.finish_reason import FinishReason
from ferrox_batch.generation_types import GenerationResult
from ferrox_batch.replies import Chunk, Finished
from ferrox_batch.server.anthropic.answer import MessagesFormat
from ferrox_batch.server.ollama.answers import OllamaFormat
from ferrox_batch.server.ollama.translation import OLLAMA_CHAT
from ferrox_batch.server.openai.chat_format import ChatFormat
from ferrox_batch.server.reasoning import ReasoningParser
from ferrox_batch.server.tools.hermes import HermesToolCalls
from ferrox_batch.usage import Usage

MODEL = "tiny"
#: Text with no marker in it (no `<`), and not only blanks, which the writers may trim.
plain = st.text(st.characters(blacklist_characters="<>\x00", blacklist_categories=("Cs",)), min_size=1,
                max_size=30).filter(lambda s: s.strip() == s and s)
arguments = st.dictionaries(st.sampled_from(["a", "city", "n"]),
                            st.one_of(st.integers(-5, 5), st.text(max_size=5), st.booleans()), max_size=2)
call = st.tuples(st.sampled_from(["f", "get_weather"]), arguments)


@st.composite
def answers(draw: st.DrawFn) -> tuple[str, FinishReason]:
    """A model's whole text, and how it ended (tool calls end a turn: a stop)."""
    thinking = draw(st.one_of(st.none(), plain))
    content = draw(st.one_of(st.none(), plain))
    calls = draw(st.lists(call, max_size=2))
    text = (f"<think>{thinking}</think>" if thinking is not None else "<think></think>") + (content or "")
    text += "".join(f'<tool_call>{json.dumps({"name": n, "arguments": a})}</tool_call>' for n, a in calls)
    reason = FinishReason.STOP if calls else draw(st.sampled_from([FinishReason.STOP, FinishReason.LENGTH]))
    return text, reason


def openai_said(text: str, reason: FinishReason) -> dict[str, Any]:
    fmt = ChatFormat(MODEL)
    fmt.reasoning, fmt.tool_parser = ReasoningParser("qwen3"), HermesToolCalls()
    choice = json.loads("".join(fmt.full([GenerationResult(reason, (), text, Usage.new(5, 3))])))["choices"][0]
    message = choice["message"]
    return {"content": message.get("content") or "", "reasoning": message.get("reasoning_content") or "",
            "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                      for c in message.get("tool_calls") or []],
            "stopped": choice["finish_reason"] in ("stop", "tool_calls")}


def anthropic_said(message: dict[str, Any]) -> dict[str, Any]:
    blocks = message["content"]
    return {"content": "".join(b["text"] for b in blocks if b["type"] == "text"),
            "reasoning": "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
            "calls": [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"],
            "stopped": message["stop_reason"] in ("end_turn", "tool_use")}


def ollama_said(lines: list[dict[str, Any]]) -> dict[str, Any]:
    messages = [line["message"] for line in lines]
    return {"content": "".join(m.get("content", "") for m in messages),
            "reasoning": "".join(m.get("thinking", "") for m in messages),
            "calls": [(c["function"]["name"], c["function"]["arguments"]) for m in messages
                      for c in m.get("tool_calls", [])],
            "stopped": lines[-1]["done_reason"] == "stop"}


def messages_format() -> MessagesFormat:
    return MessagesFormat(MODEL, 5, ReasoningParser("qwen3"), HermesToolCalls(), True)


def ollama_format() -> OllamaFormat:
    inner = ChatFormat(MODEL)
    inner.reasoning, inner.tool_parser = ReasoningParser("qwen3"), HermesToolCalls()
    return OllamaFormat(OLLAMA_CHAT, MODEL, inner, 0.0)


def streamed(fmt: MessagesFormat | OllamaFormat, pieces: list[str], final: GenerationResult) -> list[bytes]:
    async def run() -> list[bytes]:
        async def rest():
            for piece in pieces[1:]:
                yield 0, Chunk(piece)
            yield 0, Finished(final, 0.0)

        first = (0, Chunk(pieces[0])) if pieces else (0, Finished(final, 0.0))
        body = rest() if pieces else _nothing()
        return [*fmt.opening(), *[piece async for piece in fmt.stream(first, body)]]

    return asyncio.run(run())


async def _nothing():
    return
    yield


def anthropic_stream_message(raw: list[bytes]) -> dict[str, Any]:
    """The message a client accumulates from the events."""
    message: dict[str, Any] = {}
    for piece in raw:
        _, data = piece.decode().strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        kind = event["type"]
        if kind == "message_start":
            message = event["message"]
        elif kind == "content_block_start":
            message["content"].append(dict(event["content_block"], partial=""))
        elif kind == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature",
                   "input_json_delta": "partial"}[delta["type"]]
            block[key] += delta["partial_json" if key == "partial" else key]
        elif kind == "message_delta":
            message["stop_reason"] = event["delta"]["stop_reason"]
    for block in message["content"]:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["partial"] or "{}")
    return message


def cut(text: str, cuts: list[int]) -> list[str]:
    at = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(at, at[1:]) if b > a]


@settings(max_examples=80, deadline=None)
@given(answer=answers(), cuts=st.lists(st.integers(0, 10**4), max_size=10))
def test_anthropic_and_ollama_say_what_openai_says_whole_and_streamed(answer, cuts):
    text, reason = answer
    want = openai_said(text, reason)
    final = GenerationResult(reason, (), text, Usage.new(5, 3))
    assert anthropic_said(json.loads("".join(messages_format().full([final])))) == want
    assert ollama_said([json.loads("".join(ollama_format().full([final])))]) == want
    pieces = cut(text, cuts)
    assert anthropic_said(anthropic_stream_message(streamed(messages_format(), pieces, final))) == want
    lines = [json.loads(line) for piece in streamed(ollama_format(), pieces, final) for line in piece.splitlines()]
    assert ollama_said(lines) == want
