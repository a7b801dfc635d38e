"""Ollama's embedding requests, said as the `/v1/embeddings` body they amount to.

* `/api/embed`: `input` (a string or a list of strings), each one embedding, normalised to unit length as
  Ollama's are; `dimensions` keeps the first values; `truncate` (default true) cuts an input past the context
  to fit it (its last tokens: `truncate_prompt_tokens`), `false` lets the context ceiling refuse it.
* `/api/embeddings` (the older endpoint): one `prompt`, its embedding unnormalised, as Ollama returns it.

An embedding of nothing is a load request (`loading`). Options that say how to sample are a 400 here.
"""

from __future__ import annotations

from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.server.extra_fields import CONTEXT_LENGTH
from ferrox_batch.server.ollama.loading import AnsweredAtOnce, check_keep_alive
from ferrox_batch.server.ollama.options import options_fields


def embedding_body(body: dict[str, Any], name: str, context_length: int | None, *, older: bool) -> dict[str, Any]:
    """The embedding body of an `/api/embed` request (`/api/embeddings` when `older`) for the served `name`;
    `context_length`: the served context (None: unbounded)."""
    options_fields(body.get("options"), context_length=context_length, sampling=False)
    check_keep_alive(body.get("keep_alive"))
    if older:
        prompt = body.get("prompt")
        if prompt is None or prompt == "":
            raise AnsweredAtOnce({"embedding": []})
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt", prompt, "must be a string")
        return {"model": name, "input": prompt, "normalize": False}
    value = body.get("input")
    if value is None or value == "" or value == []:
        raise AnsweredAtOnce({"model": body["model"], "embeddings": []})
    if not isinstance(value, str) and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise InvalidRequest("input", value, "must be a string or a list of strings")
    request: dict[str, Any] = {"model": name, "input": value, "normalize": True}
    truncate = body.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise InvalidRequest("truncate", truncate, "must be true or false")
    if truncate is None or truncate:  # Ollama's default: an input past the context is cut to fit it
        # A prompt must leave the context one position (the batcher's rule, for generation and embedding alike).
        request["truncate_prompt_tokens"] = CONTEXT_LENGTH if context_length is None else max(1, context_length - 1)
    if body.get("dimensions") is not None:
        request["dimensions"] = body["dimensions"]
    return request
