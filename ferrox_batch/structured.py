"""`StructuredOutput`: what a request's output must be (OpenAI's `response_format`), as plain data.

`json_object` asks for any JSON object; `json_schema` for JSON valid against `schema` (kept as canonical JSON
text, so two requests with the same schema compare equal); `lark` for text in a Lark grammar (llguidance's
dialect, which may embed JSON schemas: how a forced tool call is written). The grammar engine lives with the sampler
(`models.grammar`); this module is shared vocabulary and imports neither it nor torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ferrox_batch.errors import InvalidRequest

KINDS = ("json_object", "json_schema", "lark")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    kind: str
    schema: str | None = None  # canonical JSON text of the schema (json_schema), or the grammar (lark)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest("response_format.type", self.kind, f"must be one of {', '.join(KINDS)}")
        if (self.kind != "json_object") != (self.schema is not None):
            raise InvalidRequest("response_format", self.kind, "json_schema and lark need a text, json_object none")

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> StructuredOutput:
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest("response_format.json_schema.schema", schema, "must be a JSON schema object")
        return cls("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))

    @classmethod
    def lark(cls, grammar: str) -> StructuredOutput:
        return cls("lark", grammar)

    def schema_object(self) -> Any:
        """The schema the output must match: any object for JSON mode (not for a Lark grammar)."""
        return {"type": "object"} if self.schema is None else json.loads(self.schema)
