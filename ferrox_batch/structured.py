"""`StructuredOutput`: what a request's output must be (OpenAI's `response_format`, vLLM's
`structured_outputs`), as plain data.

`json_object` asks for any JSON object; `json_schema` for JSON valid against `schema` (kept as compact JSON
text in the client's member order, so two requests with the same schema text compare equal); `lark` for text in a Lark grammar (llguidance's
dialect, which may embed JSON schemas: how a forced tool call is written); `grammar` for text in a grammar
given as Lark or as llama.cpp's GBNF (told apart and converted by the grammar engine); `regex` for text a
regular expression matches whole; `choice` for exactly one of a list of strings (kept as canonical JSON
text). The grammar engine lives with the sampler (`runtime.sampling.grammar`); this module is shared
vocabulary and imports neither it nor torch.

`MAX_SPEC_BYTES` bounds a spec's text: the grammar engine refuses a longer one before compiling anything, and
the server's readers (`response_format`, a tool's `parameters`) refuse one as they read it, naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from ferrox_batch.checks import encodable
from ferrox_batch.errors import InvalidRequest

KINDS = ("json_object", "json_schema", "lark", "grammar", "regex", "choice")
#: The most bytes a spec's text may have (a schema as compact JSON, or a Lark grammar): real tool and
#: response schemas are a few KB, large ones about 100 KB; `runtime.sampling.grammar` says what a compile costs.
MAX_SPEC_BYTES = 256 * 1024


#: How a reasoning model's thinking comes before the constrained answer (`StructuredOutput.reasoning`).
REASONING = ("implicit", "tagged")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    kind: str
    schema: str | None = None  # canonical JSON text of the schema (json_schema), or the grammar (lark)
    #: The constrained answer comes after free thinking that ends with `</think>`: "implicit" (the output
    #: begins inside it), "tagged" (only when the output opens with `<think>`); None: no thinking.
    reasoning: str | None = None
    #: Who asked, not what: neither is part of the spec's identity (equal specs share one compile).
    #: `source`: the request field that said it (what a refusal names); `client`: who holds it while its
    #: request runs (an API key's tenant or the client's address), priced against its own share of the
    #: live-grammar budget; None: no one in particular.
    source: str | None = field(default=None, compare=False)
    client: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.reasoning is not None and self.reasoning not in REASONING:
            raise InvalidRequest("reasoning", self.reasoning, f"must be one of {', '.join(REASONING)}")
        if self.kind not in KINDS:
            raise InvalidRequest("response_format.type", self.kind, f"must be one of {', '.join(KINDS)}")
        if (self.kind != "json_object") != (self.schema is not None):
            raise InvalidRequest("response_format", self.kind, "every kind but json_object needs a text")
        if self.schema is not None and (not isinstance(self.schema, str) or not encodable(self.schema)):
            raise InvalidRequest("response_format", self.kind, "must be valid Unicode text (no lone surrogate)")

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> StructuredOutput:
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest("response_format.json_schema.schema", schema, "must be a JSON schema object")
        return cls("json_schema", _canonical(schema))

    @classmethod
    def lark(cls, grammar: str) -> StructuredOutput:
        return cls("lark", grammar)

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        """A grammar in Lark or in GBNF."""
        return cls("grammar", text)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str] | tuple[str, ...]) -> StructuredOutput:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidRequest("choice", options, "must be a non-empty list of non-empty strings")
        return cls("choice", _canonical(list(options)))

    def schema_object(self) -> Any:
        """The schema the output must match: any object for JSON mode (not for a Lark grammar)."""
        return {"type": "object"} if self.schema is None else json.loads(self.schema)

    @property
    def size(self) -> int:
        """Bytes of its text (0 for JSON mode): what `MAX_SPEC_BYTES` bounds."""
        return 0 if self.schema is None else len(self.schema.encode("utf-8"))


class CompiledSpec(Protocol):
    """A `StructuredOutput` compiled for the model's tokenizer (`runtime.sampling.grammar.CompiledGrammar`): what a
    request carries from its submit to the worker, opaque to everything in between."""

    @property
    def spec(self) -> StructuredOutput: ...


def json_bytes(value: Any) -> int:
    """Bytes of `value` as a schema's text: canonical compact JSON, in UTF-8 (a lone surrogate, refused
    later, counts as the three bytes it would take)."""
    return len(_canonical(value).encode("utf-8", "surrogatepass"))


def check_spec_bytes(param: str, size: int) -> None:
    """`InvalidRequest` naming `param` when a spec of `size` bytes is over `MAX_SPEC_BYTES`."""
    if size > MAX_SPEC_BYTES:
        raise InvalidRequest(param, f"{size} bytes", f"must be at most {MAX_SPEC_BYTES} bytes as compact JSON")


def _canonical(value: Any) -> str:
    # Non-ASCII text stays as it is: its size is its UTF-8 bytes, not six per character of escapes. The
    # members keep the client's order: the grammar writes an object's properties in its schema's order,
    # as OpenAI's structured outputs do.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
