"""What a request's output must be, from every field a client may say it in: OpenAI's `response_format`,
vLLM's `structured_outputs` object, and vLLM's older `guided_*` fields.

* `response_format`: `{"type": "text"}` (free), `{"type": "json_object"}`, or `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`.
* `structured_outputs`: exactly one of `json` (a schema, as an object or as JSON text), `json_object: true`,
  `regex`, `choice` (a list of strings), `grammar` (Lark, or llama.cpp's GBNF); vLLM's other members of it
  are a 400 naming them, as they ask for what this server does not do.
* `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`: the same, one field each;
  `guided_decoding_backend` may name the engine this server runs (llguidance: `guidance`) or `auto`.

At most one of them may say anything (a 400 naming the second). Each spec's text is bounded here
(`structured.check_spec_bytes`) before anything compiles; whether it compiles is the batcher's check at
submit (a 400 `grammar_constraint`), still before anything is queued.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.server.fields import json_text
from ferrox_batch.structured import StructuredOutput, check_spec_bytes

#: `guided_*` fields -> the `structured_outputs` member each one is.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
#: `structured_outputs` members read here; vLLM's others (`structural_tag`, `whitespace_pattern`, ...) are
#: refused by name.
MEMBERS = ("json", "json_object", "regex", "choice", "grammar")
#: What `guided_decoding_backend` may say: any engine is llguidance here.
BACKENDS = ("auto", "guidance", "llguidance")


def read_structured(body: Mapping[str, Any]) -> tuple[str, StructuredOutput] | None:
    """The request's structured output and the field that said it, or None for free text."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = response_format(body.get("response_format"))
    if fmt is not None:
        found.append(("response_format", fmt))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise InvalidRequest("structured_outputs", outputs, "must be an object")
        for member, value in outputs.items():
            if value is None or (member in ("disable_fallback", "disable_any_whitespace",
                                            "disable_additional_properties") and value is False):
                continue
            if member not in MEMBERS:
                raise InvalidRequest(f"structured_outputs.{member}", value, "is not supported by this server")
            spec = _member(f"structured_outputs.{member}", member, value)
            if spec is not None:
                found.append((f"structured_outputs.{member}", spec))
    for field, member in GUIDED.items():
        value = body.get(field)
        if value is not None:
            found.append((field, _member(field, member, value)))  # type: ignore[arg-type]
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise InvalidRequest("guided_decoding_backend", backend, f"must be one of {', '.join(BACKENDS)}: this "
                                                                  "server's grammar engine is llguidance")
    if body.get("guided_whitespace_pattern") is not None:
        raise InvalidRequest("guided_whitespace_pattern", body["guided_whitespace_pattern"],
                             "is not supported by this server")
    if len(found) > 1:
        raise InvalidRequest(found[1][0], "...", f"cannot be combined with {found[0][0]}: say the output's form once")
    if not found:
        return None
    field, spec = found[0]
    # What a refusal of its cost names: the schema itself where the field holds one.
    source = f"{field}.json_schema.schema" if field == "response_format" and spec.kind == "json_schema" else field
    return field, dataclasses.replace(spec, source=source)


def _member(field: str, member: str, value: Any) -> StructuredOutput | None:
    if member == "json_object":
        if not isinstance(value, bool):
            raise InvalidRequest(field, value, "must be true or false")
        return StructuredOutput.json_object() if value else None
    if member == "json":
        if isinstance(value, str):  # a schema is walked recursively, as a body is
            value = json_text(field, value)
        if not isinstance(value, (dict, bool)):
            raise InvalidRequest(field, value, "must be a JSON schema (an object, or its JSON text)")
        spec = StructuredOutput.json_schema(value)
    elif member == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise InvalidRequest(field, value, "must be a non-empty list of non-empty strings")
        spec = StructuredOutput.choice(value)
    else:
        if not isinstance(value, str) or not value:
            raise InvalidRequest(field, value, "must be a non-empty string")
        spec = StructuredOutput.regex(value) if member == "regex" else StructuredOutput.grammar(value)
    check_spec_bytes(field, spec.size)  # before any compiling
    return spec


def response_format(value: Any) -> StructuredOutput | None:
    """OpenAI's `response_format`: `{"type": "text"}` (free text), `{"type": "json_object"}`, or
    `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("response_format", value, "must be an object with a type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise InvalidRequest("response_format.json_schema", spec, "must be an object with a schema")
        structured = StructuredOutput.json_schema(spec.get("schema", {}))
        check_spec_bytes("response_format.json_schema.schema", structured.size)  # before any compiling
        return structured
    raise InvalidRequest("response_format.type", kind, "must be text, json_object or json_schema")
