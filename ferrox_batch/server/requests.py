"""Request bodies of the OpenAI-compatible endpoints, parsed and checked before anything is queued.

Why a hand-written parser rather than pydantic models: every problem must be
an `InvalidRequest` naming the field (HTTP 400 in the OpenAI error shape, the
same type the batcher raises), never FastAPI's 422 and never a 500, and the
exact OpenAI leniencies are easier to state as code than as model config.

What it promises:

* Unknown fields are ignored, as OpenAI does; `null` means "absent" for every
  optional field.
* Fields OpenAI defines that this server cannot honour yet (`suffix`) are a
  400
  naming the field, never silently dropped; the one value of each that asks
  for nothing (`tools: []`, `logprobs: false`, ...) is accepted, because
  common clients send it.
* Every field it understands is type-checked here (a bool is not a number, a
  float is not an integer, NaN and Infinity are not JSON); ranges are checked
  by `SamplingParams` / `GenerationParams` themselves, so the server and the
  library refuse exactly the same values with the same messages.
* Error messages quote at most `errors.SHOWN_CHARS` characters of the
  offending value (`InvalidRequest` shortens it), so a 1 MB field cannot make
  a 1 MB error body.
* `n` (up to `choices.MAX_CHOICES`) and completions' `best_of` fan out into
  rows of the batch (`choices`), and so do a completion's several prompts (OpenAI's four prompt forms),
  up to `choices.MAX_PROMPT_ROWS` rows a request.
* vLLM's extra fields (`extra_fields`) are read on both endpoints; a chat's
  `messages` by `chat_messages`.

Defaults when `max_tokens` / `max_completion_tokens` are absent are supplied
by the caller (`create_app`): OpenAI's 16 for completions, 1024 for chat.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ferrox_batch.checks import UNLIMITED
from ferrox_batch.errors import SHOWN_CHARS, InvalidRequest
from ferrox_batch.runtime.loading.chat_template import ChatMessage
from ferrox_batch.server.http.body_text import refuse_lone_surrogates
from ferrox_batch.server.chat_messages import read_messages
from ferrox_batch.server.chat_rendering import ChatRendering, read_rendering
from ferrox_batch.server.choices import MAX_CHOICES, MAX_PROMPT_ROWS
from ferrox_batch.server.extra_fields import read_prompt_logprobs, read_truncation
from ferrox_batch.server.fields import Fields, is_int, json_text
from ferrox_batch.server.sampling_fields import (
    SamplingOptions,
    chat_logprobs,
    completion_logprobs,
    read_options,
)
from ferrox_batch.server.structured_fields import read_structured
from ferrox_batch.server.tools.definitions import (
    ToolCallParser,
    forced_functions,
    forced_grammar,
    read_parallel,
    read_tool_choice,
    read_tools,
)
from ferrox_batch.server.harmony.choice import HarmonyToolCalls
from ferrox_batch.server.tools.generic import GenericToolCalls
from ferrox_batch.server.tools.hermes import HermesToolCalls
from ferrox_batch.server.unhonoured import CHAT, COMPLETIONS, refuse_not_honoured

#: OpenAI's documented default for `/v1/completions`.
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Ours for `/v1/chat/completions` (OpenAI's is "as much as the context allows"): long enough
#: for a real answer, short enough that a forgotten `max_tokens` does not hold a row for the
#: whole context. The batcher still clamps it to the context ceiling.
DEFAULT_CHAT_MAX_TOKENS = 1024
#: The tool-call formats: the Hermes/Qwen `<tool_call>` blocks where the chat template renders tools, the
#: generic JSON object (tools described in a system message) where it does not, and the harmony format's
#: calls for a model that writes harmony (gpt-oss: `harmony_choice`), whose template renders the tools.
TOOL_FORMATS: dict[str, ToolCallParser] = {"hermes": HermesToolCalls(), "generic": GenericToolCalls(),
                                           "harmony": HarmonyToolCalls()}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; malformed JSON (NaN and Infinity included) is a 400, and so is a body
    nested deeper than `bounded_json.MAX_JSON_DEPTH` or holding a string that is not valid Unicode."""
    value = json_text("body", raw, shown=raw[:SHOWN_CHARS], parse_constant=_reject_constant)
    if not isinstance(value, dict):
        raise InvalidRequest("body", value, "must be a JSON object")
    refuse_lone_surrogates(raw, value)
    return value


# ---------------------------------------------------------------------------
# Parsed requests
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """`POST /v1/completions`: each prompt is text or token ids; each gets `n` choices."""

    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]
    max_tokens: int
    options: SamplingOptions
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # candidates generated per prompt, the best `n` returned (>= n)
    echo: bool = False  # each choice starts with its prompt (and its log-probabilities, when asked)
    truncate_prompt_tokens: int | None = None  # keep each prompt's last k tokens (`extra_fields`)
    return_token_ids: bool = False  # the prompt's and the output's ids in the answer
    prompt_logprobs: int | None = None  # asked for by name: alternatives per prompt token in the answer


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """`POST /v1/chat/completions`: `messages` are rendered with the checkpoint's chat template."""

    model: str | None
    messages: tuple[ChatMessage, ...]
    max_tokens: int
    options: SamplingOptions
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices returned
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI function tools, rendered by the chat template
    tool_choice: str = "none"  # none, auto, required, or "function:<name>" (`definitions.read_tool_choice`)
    parallel_tool_calls: bool = True  # whether a reply may hold several calls
    rendering: ChatRendering = ChatRendering()  # how the template renders the conversation
    tool_format: str = "hermes"  # `TOOL_FORMATS`' key: how the tools are offered and the calls read
    truncate_prompt_tokens: int | None = None  # keep the templated prompt's last k tokens (`extra_fields`)
    return_token_ids: bool = False  # the prompt's and the output's ids in the answer
    prompt_logprobs: int | None = None  # alternatives per prompt token in the answer

    @property
    def best_of(self) -> int:
        """Chat has no `best_of`: every candidate is returned."""
        return self.n

    @property
    def prompts(self) -> tuple[tuple[ChatMessage, ...]]:
        """One prompt: the conversation."""
        return (self.messages,)

    @property
    def echo(self) -> bool:
        return False

    @property
    def parses_tool_calls(self) -> bool:
        return self.tool_choice != "none"

    @property
    def forced_functions(self) -> tuple[str, ...] | None:
        """The functions a forced `tool_choice` may call; None when the calls are the model's choice."""
        return forced_functions(self.tools, self.tool_choice)


def parse_completion_request(body: Mapping[str, Any], *, default_max_tokens: int) -> CompletionRequest:
    refuse_not_honoured(body, COMPLETIONS)
    fields = Fields(body)
    common = _common(fields, default_max_tokens, completion_logprobs(fields))
    best_of = fields.integer("best_of", common["n"])
    if not common["n"] <= best_of <= MAX_CHOICES:
        raise InvalidRequest("best_of", best_of, f"must be an integer in [n, {MAX_CHOICES}] (n is {common['n']})")
    if best_of > common["n"] and common["stream"]:
        raise InvalidRequest("best_of", best_of, "cannot be streamed above n: the best are known only at the end")
    echo = fields.boolean("echo", False)
    if echo and common["stream"]:
        raise InvalidRequest("echo", echo, "cannot be streamed: send stream: false to echo the prompt")
    if echo and common["options"].logprobs is not None:  # the prompt's own log-probabilities too
        scored = max(common["options"].logprobs, common["options"].prompt_logprobs or 0)
        common["options"] = dataclasses.replace(common["options"], prompt_logprobs=scored)
    said = read_structured(body)
    if said is not None:  # its combinations (`ignore_eos`, `min_tokens`) are GenerationParams' to check
        common["options"] = dataclasses.replace(common["options"], structured=said[1])
    prompts = read_prompts(body.get("prompt"))
    if len(prompts) * best_of > MAX_PROMPT_ROWS:
        raise InvalidRequest("prompt", len(prompts), f"{len(prompts)} prompts x {best_of} candidates each are more "
                                                     f"than the {MAX_PROMPT_ROWS} rows one request may take")
    return CompletionRequest(prompts=prompts, best_of=best_of, echo=echo, **common)


def parse_chat_request(body: Mapping[str, Any], *, default_max_tokens: int, renders_tools: bool = True,
                       escape_control_text: bool = False, tool_format: str | None = None) -> ChatRequest:
    """`renders_tools`: whether the chat template renders tools (the Hermes format), else the generic one;
    `escape_control_text`: the server reads control-token text in messages' content as text (`ChatRendering`);
    `tool_format`: the format the server reads calls in whatever the template (`TOOL_FORMATS`' key; None:
    by `renders_tools`)."""
    refuse_not_honoured(body, CHAT)
    fields = Fields(body)
    common = _common(fields, default_max_tokens, chat_logprobs(fields))
    said = read_structured(body)
    structured = None if said is None else said[1]
    tools = read_tools(body.get("tools"))
    choice = read_tool_choice(body.get("tool_choice"), tools)
    parallel = read_parallel(body.get("parallel_tool_calls"))
    if tool_format is None:
        tool_format = "hermes" if renders_tools else "generic"
    forced = forced_grammar(TOOL_FORMATS[tool_format], tools, choice, parallel)
    if forced is not None:
        if said is not None:
            raise InvalidRequest(said[0], "...",
                                 f"cannot be combined with tool_choice {choice!r}, which sets the output's form")
        structured = dataclasses.replace(forced, source="tools")
    if structured is not None:  # its combinations (`ignore_eos`) are GenerationParams' to check
        common["options"] = dataclasses.replace(common["options"], structured=structured)
    return ChatRequest(messages=read_messages(body.get("messages")), tools=tools, tool_choice=choice,
                       parallel_tool_calls=parallel, tool_format=tool_format,
                       rendering=read_rendering(fields, escape_control_text=escape_control_text),
                       **common)


# ---------------------------------------------------------------------------
# Field readers
# ---------------------------------------------------------------------------


def _common(fields: Fields, default_max_tokens: int, logprobs: int | None) -> dict[str, Any]:
    """The fields both endpoints share, as keyword arguments of the request dataclasses."""
    model = fields.raw("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model", model, "must be a string")
    n = fields.integer("n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest("n", n, f"must be an integer in [1, {MAX_CHOICES}]")
    stream = fields.boolean("stream", False)
    prompt_logprobs = read_prompt_logprobs(fields, stream)
    return_token_ids = fields.boolean("return_token_ids", False)
    options = dataclasses.replace(read_options(fields, logprobs), prompt_logprobs=prompt_logprobs,
                                  stream_token_ids=return_token_ids and stream)
    return {
        "model": model,
        "n": n,
        "max_tokens": _max_tokens(fields, default_max_tokens),
        "options": options,
        "stream": stream,
        "include_usage": _include_usage(fields.raw("stream_options")),
        "truncate_prompt_tokens": read_truncation(fields),
        "return_token_ids": return_token_ids,
        "prompt_logprobs": prompt_logprobs,
    }


def _max_tokens(fields: Fields, default: int) -> int:
    # `max_completion_tokens` is OpenAI's newer name; it wins when both are sent.
    for name in ("max_completion_tokens", "max_tokens"):
        value = fields.integer(name, None)
        if value is None:
            continue
        if not 0 <= value <= UNLIMITED:
            raise InvalidRequest(name, value, "must be a non-negative integer")
        return value
    return default


def _include_usage(value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, dict):
        raise InvalidRequest("stream_options", value, "must be an object")
    include = value.get("include_usage")
    if include is None:
        return False
    if not isinstance(include, bool):
        raise InvalidRequest("stream_options.include_usage", include, "must be true or false")
    return include


def read_prompts(value: Any, name: str = "prompt") -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's four forms: a string, a list of strings, a list of token ids, or a list of token-id lists;
    each prompt of a list is one prompt of the request. `name`: the field (`input` for embeddings)."""
    if value is None:
        raise InvalidRequest(name, value, "is required")
    if isinstance(value, str):
        return (_text_prompt(name, value),)
    if not isinstance(value, list):
        raise InvalidRequest(name, value, "must be a string, a list of strings, a list of token ids, "
                                          "or a list of token-id lists")
    if not value:
        raise InvalidRequest(name, value, "must not be empty")
    if len(value) > MAX_PROMPT_ROWS and not all(is_int(v) for v in value):
        raise InvalidRequest(name, len(value), f"may hold at most {MAX_PROMPT_ROWS} prompts")
    if all(isinstance(v, str) for v in value):
        return tuple(_text_prompt(f"{name}[{i}]", v) for i, v in enumerate(value))
    if all(isinstance(v, list) for v in value):
        return tuple(_id_prompt(f"{name}[{i}]", v) for i, v in enumerate(value))
    if any(isinstance(v, (str, list)) for v in value):
        raise InvalidRequest(name, value, "must not mix strings, token ids and lists: send one form")
    return (_id_prompt(name, value),)


def _text_prompt(where: str, value: str) -> str:
    if not value:
        raise InvalidRequest(where, value, "must not be empty")
    return value


def _id_prompt(where: str, value: list[Any]) -> tuple[int, ...]:
    if not value:
        raise InvalidRequest(where, value, "must not be empty")
    for token in value:
        if not is_int(token) or token < 0:
            raise InvalidRequest(where, token, "token ids must be non-negative integers")
    return tuple(value)
