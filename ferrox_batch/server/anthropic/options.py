"""The fields of a Messages request that set what its answer may be, in the chat request's words: `tools`
and `tool_choice` (function tools, and `auto` / `required` / a named function / `none`), `thinking` (the
template's `enable_thinking`, where the server reads thinking) and the output format (a strict
`response_format` JSON schema). Each problem is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.server.fields import is_int

#: The smallest thinking budget Anthropic takes.
MIN_THINKING_BUDGET = 1024
#: The name a `output_format` schema is given as a chat `response_format`.
SCHEMA_NAME = "output"


def read_tools(value: Any) -> list[dict[str, Any]]:
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


def set_tool_choice(value: Any, has_tools: bool, chat: dict[str, Any]) -> None:
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


def set_thinking(value: Any, thinks: bool, max_tokens: int | None, chat: dict[str, Any]) -> None:
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


def read_output_format(fmt: Any, config: Any) -> dict[str, Any] | None:
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
