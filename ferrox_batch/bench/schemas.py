"""JSON schemas of known shape for the grammar benchmarks and tests, deterministic.

* `tool_schemas(n)`: a realistic forced-tool-call schema, `anyOf` `n` tools whose arguments have
  descriptions, enums, integer ranges, arrays and nested objects, about half their properties required;
  about 4 KB per tool as compact JSON.
* `optional_properties(n)`: one object of `n` optional properties of any value, the costliest shape per
  byte found for llguidance: about 7 grammar symbols per property, and a build time that grows with the
  square of their count (`runtime.sampling.grammar`).
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ("user account order item price date time city country name status type value amount currency "
          "email phone address code filter sort page limit query").split()


def tool_schemas(n: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": f"tool_{i}"},
                                                        "arguments": _object(rng, rng.randint(3, 20), 0)},
                       "required": ["name", "arguments"]} for i in range(n)]}


def optional_properties(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"k{i}": {} for i in range(n)}, "additionalProperties": False}


def _description(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 25))).capitalize() + "."


def _property(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if roll < 0.3:
        return {"type": "string", "description": _description(rng)}
    if roll < 0.45:
        return {"type": "string", "enum": [f"{rng.choice(_WORDS)}{i}" for i in range(rng.randint(2, 12))],
                "description": _description(rng)}
    if roll < 0.6:
        return {"type": "integer", "minimum": 0, "maximum": rng.randint(10, 10000), "description": _description(rng)}
    if roll < 0.7:
        return {"type": "boolean", "description": _description(rng)}
    if roll < 0.8:
        return {"type": "number", "description": _description(rng)}
    if roll < 0.9 and depth < 3:
        return {"type": "array", "items": _property(rng, depth + 1), "description": _description(rng)}
    if depth < 3:
        return _object(rng, rng.randint(2, 8), depth + 1)
    return {"type": "string", "format": "date-time"}


def _object(rng: random.Random, n: int, depth: int) -> dict[str, Any]:
    properties = {f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}_{i}": _property(rng, depth) for i in range(n)}
    return {"type": "object", "description": _description(rng), "properties": properties,
            "required": [k for k in properties if rng.random() < 0.5]}
