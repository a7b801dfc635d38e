"""Anthropic's Messages API as a surface over the engine: its body read as the chat request it amounts to
(`request`), its answer written as a message or its event stream (`answer`), its errors in its shape."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ferrox_batch.server.anthropic.answer import MessagesFormat
from ferrox_batch.server.anthropic.errors import ANTHROPIC_ERRORS
from ferrox_batch.server.anthropic.request import chat_body
from ferrox_batch.server.http.error_shapes import ErrorShape
from ferrox_batch.server.requests import TOOL_FORMATS, ChatRequest

if TYPE_CHECKING:
    from ferrox_batch.server.surface import Prepared, Preparing


@dataclass(frozen=True, slots=True)
class MessagesSurface:
    """`POST /v1/messages`."""

    errors: ErrorShape = ANTHROPIC_ERRORS

    def engine_body(self, body: Mapping[str, Any], preparer: Preparing) -> Mapping[str, Any]:
        return chat_body(body, thinks=preparer.reasoning is not None or preparer.harmony)

    def parse(self, body: Mapping[str, Any], preparer: Preparing) -> ChatRequest:
        return preparer.parse_chat(body)

    def answer_format(self, prepared: Prepared, preparer: Preparing, rid: str) -> MessagesFormat:
        request = prepared.request
        assert isinstance(request, ChatRequest)
        parser = TOOL_FORMATS[request.tool_format] if request.parses_tool_calls else None
        return MessagesFormat(preparer.answer_name(request), len(prepared.prompts[0]), preparer.reasoning, parser,
                              request.parallel_tool_calls, request.forced_functions, harmony=preparer.harmony)
