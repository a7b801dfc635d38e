"""`ReplySink` declares every argument its implementations take.

The worker calls a sink through the Protocol, so an argument a sink takes that the Protocol does not name
(`token_ids` was one) is a seam nobody can see from the type. Every class in the package that is a sink (it
defines both `chunk` and `finished`) is found in the source and its methods' parameters are compared with
the Protocol's: the same names, kinds, defaults and annotations, in the same order.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import ferrox_batch
from ferrox_batch.scheduler.sink import ReplySink

PACKAGE = Path(ferrox_batch.__file__).parent
METHODS = ("chunk", "finished")


def sink_classes() -> list[type]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            defined = {item.name for item in getattr(node, "body", []) if isinstance(item, ast.FunctionDef)}
            if isinstance(node, ast.ClassDef) and set(METHODS) <= defined and node.name != "ReplySink":
                module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
                found.append(getattr(importlib.import_module(module), node.name))
    return found


def parameters(method) -> list[tuple[str, object, object, object]]:
    return [(p.name, p.kind, p.default, p.annotation) for p in inspect.signature(method).parameters.values()]


def test_every_sink_takes_exactly_the_arguments_the_protocol_declares():
    sinks = sink_classes()
    assert {cls.__name__ for cls in sinks} >= {"QueueSink", "OnceSink", "ReplyBridge"}
    wrong = [f"{cls.__module__}.{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} is not "
             f"ReplySink.{name}{inspect.signature(getattr(ReplySink, name))}"
             for cls in sinks for name in METHODS
             if parameters(getattr(cls, name)) != parameters(getattr(ReplySink, name))]
    assert not wrong, "\n".join(wrong)
    assert "token_ids" in inspect.signature(ReplySink.chunk).parameters
