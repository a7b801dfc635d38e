"""Ollama's error shape: `{"error": "<message>"}` with the status, and the refusals only Ollama's API has.

Every refusal is made once, in OpenAI's shape (`error_shapes`); `OllamaErrors` keeps its status and
`Retry-After` and writes its message alone, as Ollama's server and its clients (`ollama.ResponseError`)
read it. A request is said to our parsers as the chat or completion body it amounts to (`translation`),
so their refusals name our fields: the message's leading field is renamed to the Ollama one it came from
(`max_tokens` -> `options.num_predict`, `response_format` -> `format`, ...), so the client reads the name
it sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ferrox_batch.errors import DecodeError
from ferrox_batch.server.http.error_shapes import error_message
from ferrox_batch.server.ollama.options import RENAMED

#: Our body fields -> the Ollama field a translated request said them in.
OLLAMA_FIELDS = {**{ours: f"options.{theirs}" for theirs, ours in RENAMED.items()},
                 "max_tokens": "options.num_predict", "seed": "options.seed", "stop": "options.stop",
                 "response_format": "format", "response_format.json_schema": "format",
                 "response_format.json_schema.schema": "format", "input": "input",
                 "truncate_prompt_tokens": "truncate", "chat_template_kwargs": "think"}


@dataclass(frozen=True, slots=True)
class OllamaErrors:
    """Ollama's shape: the status as made, the message alone, its leading field said Ollama's way."""

    def translate(self, status: int, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        message = error_message(body)
        error = body.get("error")
        param = error.get("param") if isinstance(error, Mapping) else None
        if isinstance(param, str) and message.startswith(param + " "):
            renamed = OLLAMA_FIELDS.get(param)
            if renamed is not None:
                message = renamed + message[len(param):]
        return status, {"error": message}


OLLAMA_ERRORS = OllamaErrors()


class OllamaModelNotFound(DecodeError):
    """A model name this server does not serve, as Ollama says it (404)."""

    http_status = 404
    error_type = "invalid_request_error"
    error_code = "model_not_found"
    _fields = ("model",)

    def __init__(self, model: str) -> None:
        self.model = model
        super().__init__(f"model '{model}' not found")


class FixedModel(DecodeError):
    """A model-management request (pull, push, create, copy, delete, blobs): this server serves the model it
    was started with and changes nothing on disk (403: understood, and never allowed here)."""

    http_status = 403
    error_type = "invalid_request_error"
    error_code = "fixed_model"
    _fields = ("action",)

    def __init__(self, action: str) -> None:
        self.action = action
        super().__init__(f"{action} is not supported: this server (ferrox-batch) serves a fixed model, the one it "
                         f"was started with; models cannot be pulled, pushed, created, copied or deleted through it")
