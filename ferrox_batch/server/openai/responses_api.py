"""`POST /v1/responses`, stateless: OpenAI's Responses request turned into the chat request it amounts to.

A Responses request says what a chat request says in other words: `input` (text, or a list of items:
messages, earlier `function_call`s and their `function_call_output`s), `instructions` (a system message
first), flat function `tools`, `tool_choice`, `text.format` for structured output, `max_output_tokens`.
`chat_body` rewrites it as a chat body, which the chat endpoint's parser then checks like any other, so
both endpoints accept and refuse the same things; the answer is written back in the Responses shapes by
`responses_format`.

This server keeps nothing between requests: `previous_response_id`, `conversation`, `store: true` and
`background: true` are 400s, as are the fields it cannot honour (`reasoning`, hosted tools, non-text
input parts, `include`, `truncation: "auto"`, `max_tool_calls`, `prompt`, `top_logprobs`). `metadata` and
`user` are accepted (`metadata` is echoed in the response).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.server.chat_messages import call_arguments, text_content

#: Fields whose presence (any value but the one that asks for nothing) this server cannot honour.
REFUSED = {
    "previous_response_id": (None,), "conversation": (None,), "store": (None, False), "background": (None, False),
    "reasoning": (None,), "include": (None, []), "truncation": (None, "disabled"), "max_tool_calls": (None,),
    "prompt": (None,), "top_logprobs": (None, 0), "service_tier": (None, "auto", "default"),
}
#: Fields the chat parser reads as they are (sampling and vLLM's extras), beside the ones rewritten here.
PASSED = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "seed", "top_k", "min_p",
          "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos", "cache_salt", "priority",
          "max_queue_wait_ms", "min_tokens", "stop", "stop_token_ids", "logit_bias", "bad_words",
          "allowed_token_ids", "skip_special_tokens", "include_stop_str_in_output", "chat_template_kwargs",
          "structured_outputs", "truncate_prompt_tokens", "return_token_ids")
PART_TYPES = ("input_text", "output_text", "text")


def chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat request `body` amounts to; a 400 naming the field for what it cannot say."""
    for field, nothing in REFUSED.items():
        value = body.get(field)
        if value not in nothing:
            raise InvalidRequest(field, value, "is not supported by this server (it is stateless and serves "
                                               "function tools and text only)")
    if body.get("n") not in (None, 1):
        raise InvalidRequest("n", body.get("n"), "must be 1: a response has one output")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict)
                                 or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise InvalidRequest("metadata", metadata, "must be an object of strings")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("user", user, "must be a string")
    chat: dict[str, Any] = {key: body[key] for key in PASSED if key in body}
    messages = _input(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("instructions", instructions, "must be a string")
        messages.insert(0, {"role": "system", "content": instructions})
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


def _input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("input", value, "must not be empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input", value, "must be a string or a non-empty list of items")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(where, item, "must be an item object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"),
                             "content": text_content(f"{where}.content", item.get("content"), PART_TYPES)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if not isinstance(call["id"], str) or not isinstance(item.get("name"), str):
                raise InvalidRequest(where, item, "a function_call needs a call_id and a name")
            call_arguments(f"{where}.arguments", call["function"]["arguments"])  # refused here, by its own name
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)  # calls made together stay one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise InvalidRequest(where, item, "a function_call_output needs a call_id and a string output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # an earlier answer's thinking: templates drop it from the history anyway
        else:
            raise InvalidRequest(f"{where}.type", kind, "must be message, function_call, function_call_output "
                                                         "or reasoning")
    return messages


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidRequest("tools", value, "must be a list of tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequest(f"tools[{i}].type", tool.get("type") if isinstance(tool, dict) else tool,
                                 "must be function: this server runs no hosted tools")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value  # "none", "auto", "required", or what the chat parser refuses


def _text_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("text", value, "must be an object with a format")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequest("text.format", fmt, "must be an object with a type")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema", {}),
                                                       "strict": fmt.get("strict")}}
    if fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise InvalidRequest("text.format.type", fmt.get("type"), "must be text, json_object or json_schema")
