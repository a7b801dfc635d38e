"""Which requests each benchmark shape sends: the one place that knows every shape but the chat.

Shapes a, b and s come from the texts' token stream (`bench.workloads`), d and d4 from the copying tasks
(`bench.copying`, which builds on the workloads' `Request`); this module stands above both, so neither
imports the other's caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ferrox_batch.bench.copying import copying_requests
from ferrox_batch.bench.workloads import Request, build_requests

#: The shapes whose answers copy their prompts (`bench.copying`), and the shapes sent one request at a time.
COPYING_SHAPES = ("d", "d4")
SINGLE_STREAM_SHAPES = ("s", "d")


class ShapeTokenizer(Protocol):
    """What the shapes encode with (`runtime.loading.tokenizer.Tokenizer` is one)."""

    def encode(self, text: str) -> list[int]:
        """`text`'s token ids."""

    def encode_chat(self, messages: Sequence[Any]) -> list[int]:
        """`messages` rendered with the chat template and a generation prompt, as token ids."""


def shape_requests(shape: str, tokenizer: ShapeTokenizer, seed: int = 0, quick: bool = False) -> list[Request]:
    """The requests of any shape but the chat: a, b and s from the texts' token stream, d and d4 from
    `bench.copying` (with `tokenizer`'s chat template)."""
    if shape in COPYING_SHAPES:
        return copying_requests(tokenizer.encode_chat, tokenizer.encode, concurrent=shape == "d4", quick=quick)
    return build_requests(shape, tokenizer.encode, seed, quick)
