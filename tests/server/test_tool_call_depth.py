"""A model's tool call nested past what the server reads is the answer's content, never a 500 or a cut stream.

The model's output is not the client's fault, so nothing of it is a 4xx: as vLLM does when a tool parse
fails, a reply whose call does not parse is returned as the message's content. A call nests at most
`MAX_JSON_DEPTH` levels, as a request body may (so every call the server returns can be sent back in the
history); deeper, however deep (past the interpreter's recursion limit too), it is content.

Pins: both formats' parsers and their streams, at the limit and past it; the streaming scanner holds memory
linear in a reply's depth (it once kept a path per level: the square of the depth, gigabytes for 100,000
brackets); over HTTP, with the model's text
scripted (a detokenizer that writes a deep call whatever was sampled), the whole answer is a 200 holding
the text as content and the stream ends with its final chunk and `[DONE]`.
"""

from __future__ import annotations

import json
import threading
import tracemalloc

import httpx
import pytest
from server_helpers import DEADLINE, MODEL_NAME, served
from tiny_checkpoint import TOOLS_TEMPLATE, write_tiny_checkpoint

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.bounded_json import MAX_JSON_DEPTH
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.runtime.loading.loader import load_model
from ferrox_batch.server.tools.call_scanner import Arguments, CallScanner, Named
from ferrox_batch.server.tools.definitions import ToolCall
from ferrox_batch.server.tools.generic import GenericToolCalls
from ferrox_batch.server.tools.hermes import HermesToolCalls
from ferrox_batch.server.tools.stream import ToolStream


def arguments(depth: int) -> str:
    """Arguments nesting `depth` levels: objects around arrays around an empty object."""
    text = "{}"
    for level in range(depth - 1):
        text = f"[{text}]" if level % 2 == 0 else f'{{"k": {text}}}'
    return text


def hermes(depth: int) -> str:
    return f'<tool_call>\n{{"name": "f", "arguments": {arguments(depth)}}}\n</tool_call>'


def generic(depth: int) -> str:
    return f'{{"tool_calls": [{{"name": "f", "arguments": {arguments(depth)}}}]}}'


#: Each format, its reply, and the levels a reply wraps around the arguments.
FORMATS = {"hermes": (HermesToolCalls(), hermes, 1), "generic": (GenericToolCalls(), generic, 3)}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_call_at_the_limit_parses_and_deeper_is_content(name):
    parser, reply, wrapping = FORMATS[name]
    deepest = MAX_JSON_DEPTH - wrapping
    assert parser.parse(reply(deepest)).calls == (ToolCall("f", json.dumps(json.loads(arguments(deepest)))),)
    for depth in (deepest + 1, 5_000, 100_000):
        text = reply(depth)
        parsed = parser.parse(text)
        assert parsed.calls == () and parsed.content == text


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_streamed_call_past_the_limit_ends_as_content(name):
    parser, reply, _ = FORMATS[name]
    text = reply(100_000)
    stream = ToolStream(parser)
    content = "".join(stream.feed(text[at:at + 4096])[0] for at in range(0, len(text), 4096))
    rest, _owed, calls = stream.finish()
    assert calls == () and content + rest == text


#: Bytes a scanner may hold per level of nesting: one frame of its stack (about 150 bytes) with room to
#: spare. A path per level would be eight bytes per level per level: 80 KB a level at this depth.
BYTES_PER_LEVEL = 1024


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_scanner_holds_memory_linear_in_the_depth(name):
    depth = 20_000
    _parser, reply, _ = FORMATS[name]
    text = reply(depth)
    scanner = CallScanner(lambda path: path == () if name == "hermes" else path == ("tool_calls", 0),
                          call_depth=0 if name == "hermes" else 2)
    body = text[text.index("{"):]
    tracemalloc.start()
    try:
        events = [e for at in range(0, len(body), 1000) for e in scanner.feed(body[at:at + 1000])]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BYTES_PER_LEVEL * depth, peak
    assert events[0] == Named(0, "f") and "".join(e.text for e in events if isinstance(e, Arguments)) == \
        arguments(depth) and scanner.done


class ScriptedText:
    """A detokenizer that writes `script` a piece per token, whatever was sampled, from its start again once
    a request has had it all (requests take `len(pieces)` tokens each, one at a time)."""

    def __init__(self, script: str, pieces: int) -> None:
        size = -(-len(script) // pieces)
        self.pieces = [script[at:at + size].encode() for at in range(0, len(script), size)]
        self._next = 0
        self._lock = threading.Lock()

    def __call__(self, ids: list[int]) -> bytes:
        with self._lock:
            piece = self.pieces[self._next % len(self.pieces)]
            self._next += 1
        return piece


SCRIPT = hermes(100_000)


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-deep-calls"), tie=False, std=0.15, seed=5,
                                   chat_template=TOOLS_TEMPLATE, max_positions=4096)
    model = load_model(folder, device="cpu", dtype="float32")
    script = ScriptedText(SCRIPT, 24)
    batcher = ContinuousBatcher.spawn_with_config(model.decoder, script,
                                                  BatcherConfig(kv_block_size=16, kv_blocks=256))
    batcher.tokenizer = model.tokenizer
    with served(batcher) as (base_url, _app):
        yield base_url, len(script.pieces)


def body(tokens: int, **fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "tools": [{"type": "function", "function": {"name": "f"}}],
            **fields}


def test_a_deep_call_is_answered_as_content(scripted_server):
    base_url, tokens = scripted_server
    reply = httpx.post(f"{base_url}/v1/chat/completions", json=body(tokens), timeout=DEADLINE)
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    assert choice["message"]["content"] == SCRIPT and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"


def test_a_streamed_deep_call_ends_with_its_final_chunk_and_done(scripted_server):
    base_url, tokens = scripted_server
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body(tokens, stream=True),
                      timeout=DEADLINE) as reply:
        assert reply.status_code == 200
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == SCRIPT
