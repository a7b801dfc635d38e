"""The harmony format (gpt-oss) over HTTP, through the official `openai` client.

The checkpoint is a tiny random one whose tokenizer has harmony's markers as special tokens and whose
template ends the prompt with `<|start|>assistant`, as gpt-oss's does; what it writes is set by a Lark
grammar naming those special tokens (`structured_outputs`), so the answer is the marker tokens a real
gpt-oss writes, which the detokenizer drops unless the server keeps them for its reader.

Pins: chat answers, whole and streamed, carry the analysis channel as `reasoning_content`, the final one
as `content`, and a call to `functions.NAME` as `tool_calls` (finish reason `tool_calls`), with no marker
in any text; the Responses API makes the same items; a forced `tool_choice` is a 400; either vLLM flag
turns harmony on, and a `gpt_oss` checkpoint gets both without flags (`serve`); the CLI takes vLLM's flags.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
from process_helpers import free_port
from server_helpers import DEADLINE, MODEL_NAME, openai_client, poll, served, tiny_batcher
from tiny_checkpoint import write_tiny_checkpoint
from tokenizers import AddedToken, Tokenizer

from ferrox_batch import cli
from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.cli.common import TOOL_CALL_PARSER_CHOICES
from ferrox_batch.cli.replicas import replica_app_settings
from ferrox_batch.generation_types import GenerationParams
from ferrox_batch.runtime.loading.loader import load_model
from ferrox_batch.server.app import create_app
from ferrox_batch.server.harmony.reading import MARKERS
from ferrox_batch.server.harmony.choice import TOOL_CALL_PARSERS, parsers_for_family
from ferrox_batch.server.run import serve

TEMPLATE = ("{% if tools %}<|start|>developer<|message|>{% for t in tools %}{{ t | tojson }}{% endfor %}<|end|>"
            "{% endif %}{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
            "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
ANSWER = ('start: <|channel|> "analysis" <|message|> "Hi there" <|end|> <|start|> "assistant" <|channel|> "final" '
          '<|message|> "Yes" <|return|>\n')
CALL = ('start: <|channel|> "analysis" <|message|> "Need it." <|end|> <|start|> "assistant" <|channel|> '
        '"commentary to=functions.get_weather " <|constrain|> "json" <|message|> "{\\"city\\": \\"Paris\\"}" <|call|>\n')
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
MESSAGES = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    # Room in the embedding for the markers, added after the tokenizer's training filled its own vocabulary.
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-harmony"), max_positions=2048,
                                   chat_template=TEMPLATE, extra_config={"vocab_size": 392})
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    tokenizer.save(str(folder / "tokenizer.json"))
    return load_model(folder, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def client(harmony_model):
    with served(tiny_batcher(harmony_model), reasoning_parser="openai_gptoss") as (url, _app), \
            openai_client(url, timeout=60) as c:
        yield c


def said(grammar: str) -> dict:
    return {"max_tokens": 200, "extra_body": {"structured_outputs": {"grammar": grammar}}}


def no_marker(*texts: str | None) -> bool:
    return not any(marker in (text or "") for text in texts for marker in MARKERS)


def test_thinking_and_answer_whole_and_streamed(client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **said(ANSWER)).choices[0]
    assert whole.message.model_extra["reasoning_content"] == "Hi there" and whole.message.content == "Yes"
    assert whole.finish_reason == "stop" and not whole.message.tool_calls
    chunks = [c.choices[0] for c in client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True,
                                                                   **said(ANSWER)) if c.choices]
    thinking = [c.delta.model_extra.get("reasoning_content") or "" for c in chunks]
    content = [c.delta.content or "" for c in chunks]
    assert "".join(thinking) == "Hi there" and "".join(content) == "Yes" and no_marker(*thinking, *content)
    assert chunks[-1].finish_reason == "stop"


def test_a_call_whole_and_streamed(client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], **said(CALL))
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Need it."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = [c.choices[0] for c in client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], stream=True, **said(CALL)) if c.choices]
    calls = [t for c in chunks for t in c.delta.tool_calls or ()]
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == \
        [(0, "get_weather", '{"city": "Paris"}')] and calls[0].id.startswith("call_")
    assert "".join(c.delta.model_extra.get("reasoning_content") or "" for c in chunks) == "Need it."
    assert not any(c.delta.content for c in chunks) and chunks[-1].finish_reason == "tool_calls"


def test_without_tools_a_call_is_not_content(client):
    choice = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **said(CALL)).choices[0]
    assert choice.message.content is None and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_the_responses_api_makes_the_same_items(client):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    extra = {"structured_outputs": {"grammar": CALL}}
    whole = client.responses.create(model=MODEL_NAME, input="Weather?", tools=[tool], max_output_tokens=200,
                                    extra_body=extra)
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    assert whole.output[0].content[0].text == "Need it." and whole.output[1].name == "get_weather"
    assert json.loads(whole.output[1].arguments) == {"city": "Paris"}
    events = list(client.responses.create(model=MODEL_NAME, input="Weather?", tools=[tool], max_output_tokens=200,
                                          stream=True, extra_body=extra))
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning", "function_call"]
    assert json.loads(done.output[1].arguments) == {"city": "Paris"}


def test_a_forced_call_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="harmony"):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                       max_tokens=8)


def test_the_markers_are_kept_for_the_reader_and_the_stop_tokens_added(harmony_model):
    tokenizer = harmony_model.tokenizer
    batcher = tiny_batcher(harmony_model)
    try:
        app = create_app(batcher, model_name="m", tool_call_parser="openai")
        preparer = app.state.ferrox.generations._preparer
        params = preparer._harmony_params(GenerationParams(max_tokens=4, stop_token_ids=(7,)))
        assert params.skip_special_tokens is False
        assert params.stop_token_ids == (7, tokenizer.token_to_id("<|return|>"), tokenizer.token_to_id("<|call|>"))
        with pytest.raises(ValueError, match="tool call parser"):
            create_app(batcher, model_name="m", tool_call_parser="hermes2")
    finally:
        assert batcher.close(DEADLINE)


def test_a_gpt_oss_checkpoint_gets_both_parsers():
    assert parsers_for_family("gpt_oss", None, None) == ("openai_gptoss", "openai")
    assert parsers_for_family("gpt_oss", "qwen3", None) == ("qwen3", "openai")
    assert parsers_for_family("llama", None, None) == (None, None)
    assert parsers_for_family("llama", "deepseek_r1", "openai") == ("deepseek_r1", "openai")


@contextlib.contextmanager
def serving(model) -> Iterator[str]:
    port, stop = free_port(), threading.Event()
    thread = threading.Thread(target=serve, args=(model, BatcherConfig(kv_block_size=16, kv_blocks=64), "127.0.0.1",
                                                  port), kwargs={"stop": stop, "log_level": "warning"}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(url + "/health", timeout=1).status_code == 200
        return False

    try:
        poll(up, "serve to answer", timeout=60)
        yield url
    finally:
        stop.set()
        thread.join(DEADLINE)
        assert not thread.is_alive()


def test_serve_reads_harmony_for_a_gpt_oss_checkpoint(harmony_model, monkeypatch):
    monkeypatch.setattr(type(harmony_model.config), "family", property(lambda _config: "gpt_oss"))
    with serving(harmony_model) as url, openai_client(url, timeout=60) as c:
        answer = c.chat.completions.create(model=harmony_model.source.name, messages=MESSAGES, **said(ANSWER))
    choice = answer.choices[0]
    assert choice.message.model_extra["reasoning_content"] == "Hi there" and choice.message.content == "Yes"


def test_the_cli_takes_vllms_flags():
    assert TOOL_CALL_PARSER_CHOICES == TOOL_CALL_PARSERS
    args = cli.build_parser().parse_args(["serve", "--reasoning-parser", "openai_gptoss", "--tool-call-parser",
                                          "openai", "--enable-auto-tool-choice"])
    assert (args.reasoning_parser, args.tool_call_parser) == ("openai_gptoss", "openai")
    assert replica_app_settings(args, ())["tool_call_parser"] == "openai"
    assert cli.build_parser().parse_args(["serve"]).tool_call_parser is None
