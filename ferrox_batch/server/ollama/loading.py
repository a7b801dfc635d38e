"""Ollama's load and unload requests, and `keep_alive`: answered at once, the model kept loaded regardless.

Ollama's clients load a model by asking for nothing (a generation without a prompt or with no messages, an
embedding of nothing) and unload it by asking for nothing with `keep_alive: 0`. This server serves its one
model for its whole life: such a request is answered at once, without the engine (`AnsweredAtOnce`), as
Ollama answers it (`done_reason: "load"` or `"unload"`), and nothing is loaded or unloaded. `keep_alive` is
otherwise checked (a duration or a number) and means nothing here.
"""

from __future__ import annotations

import re
from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.server.fields import is_number
from ferrox_batch.server.ollama.wire import created_at
from ferrox_batch.server.surface import AnsweredAtOnce

#: A `keep_alive` duration of zero (Go's duration syntax, or a bare number of seconds).
ZERO_DURATION = re.compile(r"^\s*-?0*(\.0*)?\s*(ns|us|µs|ms|s|m|h)?\s*$")


def check_keep_alive(value: Any) -> None:
    if value is not None and not isinstance(value, str) and not is_number(value):
        raise InvalidRequest("keep_alive", value, 'must be a duration ("5m", "1h", "0") or a number of seconds')


def unloads(value: Any) -> bool:
    """Whether `keep_alive` says "unload now" (a zero duration)."""
    if is_number(value):
        return value == 0
    return isinstance(value, str) and ZERO_DURATION.match(value) is not None


def loaded(body: dict[str, Any], answer: dict[str, Any]) -> AnsweredAtOnce:
    """The answer to a load (or, with `keep_alive: 0`, unload) generation request, `answer` its empty text."""
    check_keep_alive(body.get("keep_alive"))
    reason = "unload" if unloads(body.get("keep_alive")) else "load"
    return AnsweredAtOnce({"model": body["model"], "created_at": created_at(), **answer, "done": True,
                           "done_reason": reason})
