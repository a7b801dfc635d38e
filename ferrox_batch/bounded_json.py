"""JSON from clients, parsed with a bound on how deeply it nests.

Request bodies are parsed by the server (`server.requests.parse_json_object`) and by the Ray ingress's
router (`deploy.affinity.prompt_units`), and what they hold is then walked by code that may recurse
(schemas, tools, message content). A body of a few kilobytes can nest thousands of levels, which makes
`json.loads` raise RecursionError, and a document just under the interpreter's recursion limit would make
the next recursive walk raise it instead. `loads` refuses anything nested deeper than `MAX_JSON_DEPTH` with
`JsonTooDeep`, a ValueError like every other malformed body, and never lets a RecursionError out.

It promises: a document at most `max_depth` deep parses exactly as `json.loads` parses it (same keyword
arguments, bytes in any encoding `json.loads` detects); anything deeper, however deep, is `JsonTooDeep`.
The check walks the parsed value with an explicit stack (no recursion), and is skipped when the text holds
too few brackets to nest that deep, so a large prompt costs one count of its brackets.
"""

from __future__ import annotations

import json
from typing import Any

#: Levels of arrays and objects a request body may nest (`[]` is 1, `{"a": [1]}` is 2). Real requests nest
#: a handful (a chat's content parts are 4; a JSON schema in `response_format` rarely passes 20); 64 leaves
#: room for any of them and keeps every recursive walk of a body far below Python's recursion limit.
MAX_JSON_DEPTH = 64


class JsonTooDeep(ValueError):
    """The document nests arrays and objects deeper than the bound."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        super().__init__(f"it nests arrays and objects deeper than {max_depth} levels")


def loads(raw: str | bytes | bytearray, *, max_depth: int = MAX_JSON_DEPTH, **options: Any) -> Any:
    """`json.loads(raw, **options)`, or `JsonTooDeep` when the document nests deeper than `max_depth`."""
    try:
        value = json.loads(raw, **options)
    except RecursionError:  # deeper than the interpreter lets the C parser go: deeper than any bound
        raise JsonTooDeep(max_depth) from None
    if _more_brackets(raw, max_depth) and nesting_depth(value, stop_past=max_depth) > max_depth:
        raise JsonTooDeep(max_depth)
    return value


def nesting_depth(value: Any, *, stop_past: int | None = None) -> int:
    """How deeply `value` nests lists and dicts (a scalar is 0); the walk stops once past `stop_past`.

    Level by level, so that it holds no more than one level's containers and never recurses."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if stop_past is not None and depth > stop_past:
            return depth
        below: list[Any] = []
        keep = below.append
        for container in level:
            for child in container.values() if isinstance(container, dict) else container:
                if isinstance(child, (dict, list)):
                    keep(child)
        level = below
    return depth


def _more_brackets(raw: str | bytes | bytearray, most: int) -> bool:
    """Whether the text holds more than `most` opening brackets (strings included): if not, nothing nests
    deeper. Found one by one with `find` (a fast search, where a count walks every character), stopping
    past `most`. In bytes, every `[` and `{` holds its ASCII byte in each encoding `json.loads` reads
    (UTF-8, -16, -32)."""
    found = 0
    for bracket in ("[", "{"):
        needle = bracket if isinstance(raw, str) else bracket.encode()
        at = raw.find(needle)  # type: ignore[arg-type]
        while at >= 0:
            found += 1
            if found > most:
                return True
            at = raw.find(needle, at + 1)  # type: ignore[arg-type]
    return False
