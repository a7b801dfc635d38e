"""`POST /v1/messages/count_tokens`: the length of a Messages request's prompt, nothing generated.

The body is read as a Messages request is (`request.chat_body`, then the chat parser: the same refusals),
less `max_tokens`, and the conversation is templated exactly as it would be for generation (system,
messages, tools): `{"input_tokens": N}` is the prompt a `/v1/messages` request with this body would
submit, before any of it is read from the prompt cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.server.anthropic.request import chat_body
from ferrox_batch.server.http.errors import ModelNotFound
from ferrox_batch.server.preparation import Preparer, chat_ids
from ferrox_batch.server.request_caps import check_body
from ferrox_batch.server.requests import parse_chat_request


def count_tokens(preparer: Preparer, body: Mapping[str, Any]) -> dict[str, Any]:
    """`{"input_tokens": N}` for `body` (blocking: for the prepare pool); each problem a 400 naming its field."""
    chat = chat_body(body, thinks=preparer.reasoning is not None or preparer.harmony, counting=True)
    check_body(preparer.caps, chat)
    request = parse_chat_request(chat, default_max_tokens=1, renders_tools=preparer.tokenizer.supports_tools,
                                 escape_control_text=preparer.escape_control_tokens,
                                 tool_format="harmony" if preparer.harmony else None)
    if request.model not in (preparer.model_name, *preparer.aliases):
        raise ModelNotFound(str(request.model), ", ".join((preparer.model_name, *preparer.aliases)))
    return {"input_tokens": len(chat_ids(preparer.tokenizer, request, None))}
