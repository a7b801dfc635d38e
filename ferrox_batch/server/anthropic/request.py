"""A Messages request (`POST /v1/messages`) rewritten as the chat request it amounts to.

`chat_body` says in the chat endpoint's words what a Messages body says: `system` becomes the first
message, each message's blocks become chat messages (`text` joined, `tool_use` an assistant's
`tool_calls`, `tool_result` a `tool` message, earlier `thinking` dropped as templates drop it), a last
assistant message is continued (Anthropic's prefill: `continue_final_message`), `tools` and
`tool_choice` become function tools, `stop_sequences` `stop`, `thinking` the template's
`enable_thinking`, `output_format` (or `output_config.format`) a `response_format` JSON schema. The chat
parser then checks the result like any chat body, so both endpoints accept and refuse the same things.

Every field this server does not know, or cannot honour, is a 400 naming it (a field sent as `null` is
absent); a block that is not text (an image, a document, ...) is a 400 naming `messages[i].content[j].type`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.server.fields import is_int

#: Anthropic's fields this server honours (a field's checks are below, or the chat parser's).
FIELDS = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
                    "top_k", "metadata", "stream", "tools", "tool_choice", "thinking", "output_format",
                    "output_config", "service_tier", "cache_control"})
#: The engine's own sampling and scheduling fields, read by the chat parser as they are (as on chat).
EXTRAS = ("seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
          "min_tokens", "priority", "max_queue_wait_ms", "cache_salt", "stop_token_ids", "logit_bias",
          "bad_words", "allowed_token_ids", "skip_special_tokens", "chat_template_kwargs", "structured_outputs")
#: What each block type of a message may be; any other type is refused by its name.
BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
#: The smallest thinking budget Anthropic takes.
MIN_THINKING_BUDGET = 1024
#: The name a `output_format` schema is given as a chat `response_format`.
SCHEMA_NAME = "output"


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
    messages = _messages(body.get("messages"))
    system = body.get("system")
    if system is not None:
        messages.insert(0, {"role": "system", "content": _text("system", system)})
    chat["messages"] = messages
    if messages[-1]["role"] == "assistant":  # a prefilled answer: the model goes on from it
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    _tool_choice(body.get("tool_choice"), bool(tools), chat)
    _thinking(body.get("thinking"), thinks, chat.get("max_tokens"), chat)
    fmt = _output_format(body.get("output_format"), body.get("output_config"))
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


def _text(where: str, value: Any) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequest(where, value, "must be a string or a list of text blocks")
    texts = []
    for i, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise InvalidRequest(f"{where}[{i}].type", kind, "is not supported: this server takes text blocks here")
        if not isinstance(block.get("text"), str):
            raise InvalidRequest(f"{where}[{i}].text", block.get("text"), "must be a string")
        texts.append(block["text"])
    return "".join(texts)


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages", value, "must be a non-empty list of messages")
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(where, message, "must be an object with a role and a content")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise InvalidRequest(f"{where}.role", role, "must be user or assistant (the system prompt is `system`)")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
        elif isinstance(content, list):
            messages.extend(_blocks(where, role, content))
        else:
            raise InvalidRequest(f"{where}.content", content, "must be a string or a list of content blocks")
    if not messages:
        raise InvalidRequest("messages", value, "must hold some text, tool use or tool result")
    return messages


def _blocks(where: str, role: str, blocks: list[Any]) -> list[dict[str, Any]]:
    """One message's blocks as chat messages: an assistant's text and calls as one turn; a user's tool results
    as `tool` messages and its text between them as user turns, in their order."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in BLOCKS:
            raise InvalidRequest(f"{at}.type", kind, f"is not supported: this server takes {', '.join(BLOCKS)} "
                                                     "blocks")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise InvalidRequest(f"{at}.text", block.get("text"), "must be a string")
            texts.append(block["text"])
        elif kind in ("thinking", "redacted_thinking"):
            continue  # an earlier answer's thinking: chat templates leave it out of the history
        elif kind == "tool_use":
            if role != "assistant":
                raise InvalidRequest(f"{at}.type", kind, "is an assistant's block")
            calls.append(_call(at, block))
        else:  # tool_result
            if role != "user":
                raise InvalidRequest(f"{at}.type", kind, "is a user's block")
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
                texts = []
            out.append(_result(at, block))
    if role == "assistant":
        if texts or calls:
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    elif texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _call(at: str, block: Mapping[str, Any]) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"{at}.id", call_id, "must be a non-empty string")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{at}.name", name, "must be a non-empty string")
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{at}.input", arguments, "must be an object")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _result(at: str, block: Mapping[str, Any]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"{at}.tool_use_id", call_id, "must be a non-empty string")
    content = block.get("content")
    text = "" if content is None else _text(f"{at}.content", content)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise InvalidRequest(f"{at}.is_error", is_error, "must be true or false")
    if is_error:  # chat templates have no error flag: the result says it in words
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest("tools", value, "must be a list of tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequest(where, tool, "must be a tool object")
        if tool.get("type") not in (None, "custom"):
            raise InvalidRequest(f"{where}.type", tool["type"], "must be custom: this server runs no server tools")
        for key, item in tool.items():
            if key not in ("type", "name", "description", "input_schema", "cache_control") and item not in (None, False):
                raise InvalidRequest(f"{where}.{key}", item, "is not supported by this server")
        name, schema, description = tool.get("name"), tool.get("input_schema"), tool.get("description")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{where}.name", name, "must be a non-empty string")
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{where}.input_schema", schema, "must be a JSON schema object")
        if description is not None and not isinstance(description, str):
            raise InvalidRequest(f"{where}.description", description, "must be a string")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if description is not None:
            function["description"] = description
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any, has_tools: bool, chat: dict[str, Any]) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise InvalidRequest("tool_choice", value, "must be an object with a type")
    kind = value.get("type")
    parallel = value.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise InvalidRequest("tool_choice.disable_parallel_tool_use", parallel, "must be true or false")
        chat["parallel_tool_calls"] = not parallel
    if kind in ("auto", "none"):
        if has_tools:  # without tools there is nothing to choose from, and nothing to refuse
            chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool":
        name = value.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("tool_choice.name", name, "must name one of the request's tools")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise InvalidRequest("tool_choice.type", kind, "must be auto, any, tool or none")


def _thinking(value: Any, thinks: bool, max_tokens: int | None, chat: dict[str, Any]) -> None:
    """`enabled` (with a budget) and `adaptive` need a server that reads thinking; `disabled` asks the template
    not to think. Either way the template gets `enable_thinking` (templates that know it, as Qwen3's, obey)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise InvalidRequest("thinking", value, "must be an object with a type")
    kind = value.get("type")
    if kind == "disabled":
        _template_flag(chat, False)
        return
    if kind not in ("enabled", "adaptive"):
        raise InvalidRequest("thinking.type", kind, "must be enabled, adaptive or disabled")
    if not thinks:
        raise InvalidRequest("thinking", value, "needs a server started with a reasoning parser "
                                                "(--reasoning-parser): this one does not read thinking")
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if not is_int(budget) or budget < MIN_THINKING_BUDGET:
            raise InvalidRequest("thinking.budget_tokens", budget,
                                 f"must be an integer of at least {MIN_THINKING_BUDGET}")
        if max_tokens is not None and budget >= max_tokens:
            raise InvalidRequest("thinking.budget_tokens", budget,
                                 f"must be less than max_tokens ({max_tokens}): thinking counts toward it")
    _template_flag(chat, True)


def _template_flag(chat: dict[str, Any], thinking: bool) -> None:
    kwargs = chat.get("chat_template_kwargs")
    if kwargs is None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    elif isinstance(kwargs, dict):  # what the client set itself wins
        chat["chat_template_kwargs"] = {"enable_thinking": thinking, **kwargs}


def _output_format(fmt: Any, config: Any) -> dict[str, Any] | None:
    where = "output_format"
    if config is not None:
        if not isinstance(config, dict):
            raise InvalidRequest("output_config", config, "must be an object")
        for key, item in config.items():
            if key != "format" and item is not None:
                raise InvalidRequest(f"output_config.{key}", item, "is not supported by this server")
        if config.get("format") is not None:
            if fmt is not None:
                raise InvalidRequest("output_format", fmt, "cannot be combined with output_config.format")
            fmt, where = config["format"], "output_config.format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise InvalidRequest(f"{where}.type", fmt.get("type") if isinstance(fmt, dict) else fmt,
                             "must be json_schema")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where}.schema", schema, "must be a JSON schema object")
    return {"type": "json_schema", "json_schema": {"name": SCHEMA_NAME, "schema": schema, "strict": True}}
