"""A Messages request's `messages` (and `system`) as chat messages, each problem a 400 naming the block.

A message's blocks become chat messages in their order: `text` blocks joined, an assistant's `tool_use`
blocks its turn's `tool_calls` (the input as JSON arguments), a user's `tool_result` blocks `tool`
messages (an error result says so in words: chat templates have no error flag) with the user's text
around them as user turns, and earlier `thinking` dropped, as chat templates drop it. Any other block (an
image, a document, a server tool's) is a 400 naming `messages[i].content[j].type`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ferrox_batch.errors import InvalidRequest

#: What each block type of a message may be; any other type is refused by its name.
BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def text_of(where: str, value: Any) -> str:
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


def read_messages(value: Any) -> list[dict[str, Any]]:
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
    text = "" if content is None else text_of(f"{at}.content", content)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise InvalidRequest(f"{at}.is_error", is_error, "must be true or false")
    if is_error:  # chat templates have no error flag: the result says it in words
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}
