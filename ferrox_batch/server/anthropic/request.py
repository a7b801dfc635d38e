"""A Messages request (`POST /v1/messages`) rewritten as the chat request it amounts to.

`chat_body` says in the chat endpoint's words what a Messages body says: `system` becomes the first
message, each message's blocks become chat messages (`text` joined, `tool_use` an assistant's
`tool_calls`, `tool_result` a `tool` message, earlier `thinking` dropped as templates drop it), a last
assistant message is continued (Anthropic's prefill: `continue_final_message`), `tools` and
`tool_choice` become function tools, `stop_sequences` `stop`, `thinking` the template's
`enable_thinking`, `output_format` (or `output_config.format`) a `response_format` JSON schema. The chat
parser then checks the result like any chat body, so both endpoints accept and refuse the same things.

Every field this server does not know, or cannot honour, is a 400 naming it (a field sent as `null` is
absent). The messages are read by `messages`, the fields that set what the answer may be (tools,
thinking, output format) by `options`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.server.anthropic.messages import read_messages, text_of
from ferrox_batch.server.anthropic.options import read_output_format, set_thinking, set_tool_choice, read_tools
from ferrox_batch.server.fields import is_int

#: Anthropic's fields this server honours (a field's checks are below, or the chat parser's).
FIELDS = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
                    "top_k", "metadata", "stream", "tools", "tool_choice", "thinking", "output_format",
                    "output_config", "service_tier", "cache_control"})
#: The engine's own sampling and scheduling fields, read by the chat parser as they are (as on chat).
EXTRAS = ("seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
          "min_tokens", "priority", "max_queue_wait_ms", "cache_salt", "stop_token_ids", "logit_bias",
          "bad_words", "allowed_token_ids", "skip_special_tokens", "chat_template_kwargs", "structured_outputs")


def chat_body(body: Mapping[str, Any], *, thinks: bool, counting: bool = False) -> dict[str, Any]:
    """The chat request `body` amounts to; a 400 naming the field for what it cannot say. `thinks`: the
    server reads thinking (a reasoning parser); `counting`: for `count_tokens` (no `max_tokens` needed)."""
    for field, value in body.items():
        if value is not None and field not in FIELDS and field not in EXTRAS:
            raise InvalidRequest(field, value, "is not supported by this server")
    chat: dict[str, Any] = {key: body[key] for key in EXTRAS if key in body}
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model", model, "is required: the name of the served model")
    chat["model"] = model
    if not counting:
        chat["max_tokens"] = _max_tokens(body.get("max_tokens"))
        for key in ("temperature", "top_p", "top_k", "stream"):
            if key in body:
                chat[key] = body[key]
        if body.get("stop_sequences") is not None:
            if not isinstance(body["stop_sequences"], list):
                raise InvalidRequest("stop_sequences", body["stop_sequences"], "must be a list of strings")
            chat["stop"] = body["stop_sequences"]
    _check_metadata(body.get("metadata"))
    if body.get("service_tier") not in (None, "auto"):
        raise InvalidRequest("service_tier", body["service_tier"], "must be auto: this server has one tier")
    messages = read_messages(body.get("messages"))
    system = body.get("system")
    if system is not None:
        messages.insert(0, {"role": "system", "content": text_of("system", system)})
    chat["messages"] = messages
    if messages[-1]["role"] == "assistant":  # a prefilled answer: the model goes on from it
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    tools = read_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    set_tool_choice(body.get("tool_choice"), bool(tools), chat)
    set_thinking(body.get("thinking"), thinks, chat.get("max_tokens"), chat)
    fmt = read_output_format(body.get("output_format"), body.get("output_config"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


def _max_tokens(value: Any) -> int:
    if value is None:
        raise InvalidRequest("max_tokens", value, "is required")
    if not is_int(value) or value < 1:
        raise InvalidRequest("max_tokens", value, "must be a positive integer")
    return int(value)


def _check_metadata(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise InvalidRequest("metadata", value, "must be an object")
    for key, item in value.items():
        if key != "user_id":
            raise InvalidRequest(f"metadata.{key}", item, "is not supported: metadata takes user_id only")
        if item is not None and not isinstance(item, str):
            raise InvalidRequest("metadata.user_id", item, "must be a string")
