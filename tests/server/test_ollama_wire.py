"""Ollama's wire, over plain HTTP: NDJSON streams, whole answers, content types, busy refusals and a fuzz.

Pins: a stream is `application/x-ndjson` whose every line is one JSON object, exactly one of them
`done: true` and last, with RFC 3339 `created_at`s and durations that are positive integers in
nanoseconds, the total at least its measured parts; `stream: false` is one JSON object; a POST whose
Content-Type is not JSON (curl's form type, none) is served under `/api/` when no browser sent it (no
`Origin`), and refused with 415 in Ollama's shape when one did; a busy server refuses with 503,
`Retry-After` and `{"error": ...}` before any stream; a failure after the stream began is a last line
`{"error": ...}`; tool calls (Hermes or harmony) go out whole with object arguments, and harmony's
analysis channel as `thinking`; random bodies and options never get a 5xx, and every refusal is
`{"error": <str>}`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from datetime import datetime
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import DEADLINE, MODEL_NAME, gated_batcher, letter_gate, poll, served

from ferrox_batch.errors import QueueFull
from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.replies import Chunk, Finished
from ferrox_batch.server.openai.chat_format import ChatFormat
from ferrox_batch.server.ollama.answers import OllamaFormat
from ferrox_batch.server.ollama.translation import OLLAMA_CHAT, OLLAMA_GENERATE
from ferrox_batch.server.harmony.choice import HarmonyToolCalls
from ferrox_batch.server.tools.hermes import HermesToolCalls
from ferrox_batch.usage import Usage

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}],
        "options": {"temperature": 0, "num_predict": 6}}
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


@pytest.fixture(scope="module")
def gate():
    return letter_gate(permits=None)  # open; a test that holds it opens it again


@pytest.fixture(scope="module")
def server(tiny_batch_model, gate):
    with served(gated_batcher(tiny_batch_model, gate), max_concurrent_requests=1) as (base_url, app):
        yield base_url, app


def lines_of(reply: httpx.Response) -> list[dict[str, Any]]:
    text = reply.text
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def check_final(final: dict[str, Any]) -> None:
    assert final["done"] is True and final["done_reason"] in ("stop", "length")
    for field in DURATIONS + ("prompt_eval_count", "eval_count"):
        assert isinstance(final[field], int) and not isinstance(final[field], bool), field
    for field in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert final[field] > 0, field
    assert final["total_duration"] >= final["load_duration"] + final["prompt_eval_duration"] + final["eval_duration"]


def rfc3339(value: str) -> datetime:
    assert value.endswith("Z")
    return datetime.fromisoformat(value.removesuffix("Z") + "+00:00")


@pytest.mark.parametrize("path, body, key", [
    ("/api/chat", CHAT, "message"),
    ("/api/generate", {"model": MODEL_NAME, "prompt": "Hello", "options": {"temperature": 0, "num_predict": 6}},
     "response"),
])
def test_a_stream_is_ndjson_ending_in_one_done_line(server, path, body, key):
    reply = httpx.post(server[0] + path, json=body, timeout=DEADLINE)
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/x-ndjson"
    lines = lines_of(reply)
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    times = [rfc3339(line["created_at"]) for line in lines]
    assert times == sorted(times) and all(line["model"] == MODEL_NAME for line in lines)
    check_final(lines[-1])
    assert lines[-1]["eval_count"] == 6 or lines[-1]["done_reason"] == "stop"
    pieces = [line[key]["content"] if key == "message" else line[key] for line in lines]
    whole = httpx.post(server[0] + path, json={**body, "stream": False}, timeout=DEADLINE)
    assert whole.headers["content-type"] == "application/json"
    answer = whole.json()
    check_final(answer)
    assert "".join(pieces) == (answer[key]["content"] if key == "message" else answer[key])
    assert answer["eval_count"] == lines[-1]["eval_count"]


def test_a_post_from_no_browser_may_have_any_type_one_from_a_browser_must_say_json(server):
    raw = json.dumps({**CHAT, "stream": False}).encode()
    for headers in ({"Content-Type": "application/x-www-form-urlencoded"}, {"Content-Type": "text/plain"}, {}):
        served_ = httpx.post(server[0] + "/api/chat", content=raw, headers=headers, timeout=DEADLINE)
        assert served_.status_code == 200 and served_.json()["done"], headers
        browser = httpx.post(server[0] + "/api/chat", content=raw, headers={**headers, "Origin": "http://page.example"},
                             timeout=DEADLINE)
        assert browser.status_code == 415 and "application/json" in browser.json()["error"], headers
    json_from_page = httpx.post(server[0] + "/api/chat", content=raw, timeout=DEADLINE,
                                headers={"Content-Type": "application/json", "Origin": "http://page.example"})
    assert json_from_page.status_code == 200
    # Elsewhere, the OpenAI API keeps its rule whoever sends it.
    assert httpx.post(server[0] + "/v1/chat/completions", content=raw, timeout=DEADLINE,
                      headers={"Content-Type": "text/plain"}).status_code == 415


def test_a_busy_server_refuses_before_the_stream_in_ollamas_shape(server, gate):
    base_url, app = server
    gate.hold()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, base_url + "/api/chat", json=CHAT, timeout=DEADLINE)
            gate.wait_calls(gate.calls + 1)
            poll(lambda: len(app.state.ferrox.generations.in_flight) == 1, "the request to be in flight")
            busy = httpx.post(base_url + "/api/generate", json={"model": MODEL_NAME, "prompt": "x"}, timeout=DEADLINE)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert list(busy.json()) == ["error"] and "capacity" in busy.json()["error"]
            gate.open()
            assert lines_of(held.result(DEADLINE))[-1]["done"] is True
    finally:
        gate.open()


def test_routing_errors_and_management_are_in_ollamas_shape(server):
    base_url = server[0]
    missing = httpx.get(base_url + "/api/nowhere", timeout=DEADLINE)
    assert missing.status_code == 404 and list(missing.json()) == ["error"]
    wrong = httpx.get(base_url + "/api/chat", timeout=DEADLINE)
    assert wrong.status_code == 405 and list(wrong.json()) == ["error"]
    for method, path in (("POST", "/api/pull"), ("POST", "/api/push"), ("POST", "/api/create"),
                         ("POST", "/api/copy"), ("DELETE", "/api/delete"), ("POST", "/api/blobs/sha256:00"),
                         ("HEAD", "/api/blobs/sha256:00")):
        refused = httpx.request(method, base_url + path, json={"model": "x"}, timeout=DEADLINE)
        assert refused.status_code == 403, path
        if method != "HEAD":
            assert "fixed model" in refused.json()["error"], path
    bad = httpx.post(base_url + "/api/chat", json={**CHAT, "format": "yaml"}, timeout=DEADLINE)
    assert bad.status_code == 400 and bad.json()["error"].startswith("format")
    broken = httpx.post(base_url + "/api/chat", content=b"{not json", timeout=DEADLINE)
    assert broken.status_code == 400 and isinstance(broken.json()["error"], str)


def result(text: str, reason: FinishReason = FinishReason.STOP) -> GenerationResult:
    return GenerationResult(reason, (1,) * 3, text, Usage.new(4, 3).with_timings(0.001, 0.002).with_queue_time(0.0))


async def drained(fmt: OllamaFormat, events: list[Any]) -> list[dict[str, Any]]:
    async def rest():
        for event in events[1:]:
            yield 0, event
    return [json.loads(piece) async for piece in fmt.stream((0, events[0]), rest())]


def test_a_failure_after_the_first_line_ends_the_stream_with_an_error_line():
    fmt = OllamaFormat(OLLAMA_GENERATE, MODEL_NAME, ChatFormat(MODEL_NAME), 0.0)
    lines = asyncio.run(drained(fmt, [Chunk("Hel"), Chunk("lo"), Finished(QueueFull(1, 1))]))
    assert [line.get("response") for line in lines[:2]] == ["Hel", "lo"]
    assert lines[-1] == {"error": str(QueueFull(1, 1))} and len(lines) == 3


def test_tool_calls_go_out_whole_with_object_arguments_streamed_or_not():
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'

    def ollama_format() -> OllamaFormat:
        inner = ChatFormat(MODEL_NAME)
        inner.tool_parser = HermesToolCalls()
        return OllamaFormat(OLLAMA_CHAT, MODEL_NAME, inner, 0.0)

    whole = json.loads("".join(ollama_format().full([result(text)])))
    want = [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert whole["message"]["tool_calls"] == want and whole["message"]["content"].strip() == "Sure."
    assert whole["done_reason"] == "stop"
    pieces = [Chunk(text[i:i + 5]) for i in range(0, len(text), 5)]
    lines = asyncio.run(drained(ollama_format(), [*pieces, Finished(result(text))]))
    assert [c for line in lines for c in line["message"].get("tool_calls", [])] == want
    assert "".join(line["message"]["content"] for line in lines).strip() == "Sure."
    assert [line["done"] for line in lines][-1] is True and sum(line["done"] for line in lines) == 1


# ---------------------------------------------------------------------------- fuzz

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 10), st.integers(-2**64, 2**64),
                    st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=6))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=4), SCALARS, max_size=3))
OPTION_NAMES = ["temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed", "stop", "num_ctx",
                "repeat_last_n", "typical_p", "tfs_z", "mirostat", "mirostat_tau", "num_thread", "num_gpu",
                "use_mmap", "presence_penalty", "frequency_penalty", "penalize_newline", "bogus"]
OPTIONS = st.dictionaries(st.sampled_from(OPTION_NAMES), VALUES, max_size=5)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bot", 3])},
                                optional={"content": VALUES, "images": VALUES, "tool_calls": VALUES,
                                          "thinking": VALUES})
FIELDS = {"model": st.sampled_from([MODEL_NAME, f"{MODEL_NAME}:latest", "other", "", 5]),
          "stream": st.one_of(st.booleans(), VALUES), "options": st.one_of(OPTIONS, VALUES),
          "format": st.one_of(st.sampled_from(["json", "", {"type": "object"}]), VALUES),
          "keep_alive": VALUES, "think": VALUES, "raw": VALUES, "system": VALUES, "prompt": VALUES,
          "suffix": VALUES, "template": VALUES, "context": VALUES, "images": VALUES, "tools": VALUES,
          "messages": st.one_of(st.lists(MESSAGE, max_size=3), VALUES), "input": VALUES, "truncate": VALUES,
          "dimensions": VALUES, "logprobs": VALUES, "name": VALUES}
#: A plausible request per route, which the fuzz then changes in a few fields.
BASES = {"/api/chat": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]},
         "/api/generate": {"model": MODEL_NAME, "prompt": "Hi"},
         "/api/embed": {"model": MODEL_NAME, "input": ["Hi", "there"]},
         "/api/embeddings": {"model": MODEL_NAME, "prompt": "Hi"}, "/api/show": {"model": MODEL_NAME}}
CHANGES = st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: FIELDS[name] for name in names}))
PATHS = st.sampled_from(sorted(BASES))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(path=PATHS, changes=CHANGES, drop=st.booleans())
def test_random_requests_never_get_a_5xx_and_errors_are_ollamas_shape(server, path, changes, drop):
    body = {**BASES[path], **changes}
    if drop:  # and without its main field
        body.pop(next(iter(set(BASES[path]) - {"model"}), "model"), None)
    options = body.get("options")
    if path in ("/api/chat", "/api/generate"):  # every generation stays short
        if options is None:
            body["options"] = {"num_predict": 3}
        elif isinstance(options, dict):
            options["num_predict"] = 3
    reply = httpx.post(server[0] + path, json=body, timeout=DEADLINE)
    assert reply.status_code < 500, reply.text
    if reply.status_code >= 400:
        error = reply.json()
        assert list(error) == ["error"] and isinstance(error["error"], str) and error["error"]
    elif reply.headers["content-type"] == "application/x-ndjson":
        lines = lines_of(reply)
        assert sum(line.get("done") is True for line in lines) == 1 and lines[-1]["done"] is True
    else:
        assert isinstance(reply.json(), dict)


def test_a_harmony_answer_is_read_into_thinking_content_and_calls():
    text = ("<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')

    def ollama_format() -> OllamaFormat:
        inner = ChatFormat(MODEL_NAME)
        inner.harmony, inner.tool_parser = True, HarmonyToolCalls()
        return OllamaFormat(OLLAMA_CHAT, MODEL_NAME, inner, 0.0)

    whole = json.loads("".join(ollama_format().full([result(text)])))["message"]
    assert whole["thinking"] == "Need it." and whole["content"] == ""
    assert whole["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    lines = asyncio.run(drained(ollama_format(), [*(Chunk(text[i:i + 7]) for i in range(0, len(text), 7)),
                                                  Finished(result(text))]))
    assert "".join(line["message"].get("thinking", "") for line in lines) == "Need it."
    assert [c for line in lines for c in line["message"].get("tool_calls", [])] == whole["tool_calls"]
