"""A chat request's `messages`, read into `ChatMessage`s the chat template renders, each problem an
`InvalidRequest` naming the message and its field.

What it promises: only OpenAI's roles (`CHAT_ROLES`); text content only (a string, or a list of text parts,
joined); an assistant turn's `tool_calls` handed to the template with their `arguments` as the JSON value
they hold, read as a body is (`fields.json_text`: nested no deeper, since the template walks them).
"""

from __future__ import annotations

from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.runtime.loading.chat_template import ChatMessage
from ferrox_batch.server.fields import json_text

#: OpenAI's chat roles; any other is refused rather than handed to the chat template.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def read_messages(value: Any) -> tuple[ChatMessage, ...]:
    if value is None:
        raise InvalidRequest("messages", value, "is required")
    if not isinstance(value, list):
        raise InvalidRequest("messages", value, "must be a list of messages")
    if not value:
        raise InvalidRequest("messages", value, "must hold at least one message")
    return tuple(_message(i, m) for i, m in enumerate(value))


def _message(index: int, message: Any) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequest(where, message, "must be an object with a role and a content")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidRequest(f"{where}.role", role, "must be a non-empty string")
    if role not in CHAT_ROLES:
        raise InvalidRequest(f"{where}.role", role, f"must be one of {', '.join(CHAT_ROLES)}")
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
            raise InvalidRequest(f"{where}.tool_calls", calls, "must be an assistant's list of function calls")
        content = message.get("content")  # an assistant turn that only called tools has none
        text = "" if content is None else text_content(f"{where}.content", content)
        return ChatMessage(role, text, tuple(_tool_call_for_template(f"{where}.tool_calls[{i}]", c)
                                             for i, c in enumerate(calls)))
    call_id = message.get("tool_call_id")
    if role == "tool" and call_id is not None and not isinstance(call_id, str):
        raise InvalidRequest(f"{where}.tool_call_id", call_id, "must be a string")
    return ChatMessage(role, text_content(f"{where}.content", message.get("content")),
                       tool_call_id=call_id if role == "tool" else None)


def _tool_call_for_template(where: str, call: dict[str, Any]) -> dict[str, Any]:
    """An earlier call as templates expect it: the arguments as an object where they are JSON."""
    function = dict(call["function"])
    function["arguments"] = call_arguments(f"{where}.function.arguments", function.get("arguments"))
    return {**call, "function": function}


def call_arguments(where: str, arguments: Any) -> Any:
    """A call's `arguments` as the template reads them: the JSON value of a string that holds JSON, anything
    else as sent. JSON nested deeper than a request body may nest is a 400 naming `where`: the template walks
    it recursively, as it walks the body."""
    if not isinstance(arguments, str):
        return arguments
    return json_text(where, arguments, lenient=True)  # not JSON: left as the client sent it


def text_content(where: str, content: Any, part_types: tuple[str, ...] = ("text",)) -> str:
    """A string, or OpenAI's list of content parts when every part is text (joined); `part_types`: the
    types a text part may have (chat's `text`; the Responses API's `input_text` and `output_text` too)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in part_types or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}[{i}]", part, f"must be a text part ({' or '.join(part_types)}, with "
                                                     "its text): this server takes text only")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequest(where, content, "must be a string (or a list of text parts)")
